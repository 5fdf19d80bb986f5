"""Published forward multiply-add counts of keras.applications models.

These are the reference figures `tests/test_graph_applications.py` and
`benchmarks/graph_extraction.py` compare `ModelGraph.multiply_adds` with, at
batch 1 and the models' default input sizes. Papers call these "FLOPs" or
"Mult-Adds"; both mean multiply-accumulates of the convolution and
fully-connected layers. Sources and reasoning: `docs/graph.md`.
"""

PUBLISHED_MULTIPLY_ADDS = {
    # He et al., "Deep Residual Learning for Image Recognition", CVPR 2016, Table 1:
    # 50-layer: 3.8 x 10^9 FLOPs (Sec. 3.3 defines FLOPs as multiply-adds).
    "ResNet50": {"value": 3.8e9, "input": (224, 224, 3),
                 "source": "He et al. 2016 (arXiv:1512.03385), Table 1"},
    # Simonyan & Zisserman do not tabulate FLOPs; 15.5e9 (15.47e9: 15.35e9 in the
    # 13 convolutions + 0.12e9 in the 3 dense layers) is the torchvision model
    # table figure; "15.3 billion" quoted elsewhere counts the convolutions only.
    "VGG16": {"value": 15.5e9, "input": (224, 224, 3),
              "source": "torchvision models table (vgg16: 15.47 GFLOPS = G multiply-adds)"},
    # Sandler et al., "MobileNetV2", CVPR 2018, Table 4: 300M MAdds, 3.4M params.
    "MobileNetV2": {"value": 300e6, "input": (224, 224, 3),
                    "source": "Sandler et al. 2018 (arXiv:1801.04381), Table 4"},
    # Szegedy et al., "Rethinking the Inception Architecture", CVPR 2016, abstract:
    # "a computational cost of 5 billion multiply-adds per inference", a rounded
    # figure; the architecture at 299x299 (Keras' InceptionV3, torchvision's
    # inception_v3 without the auxiliary head) has 5.71-5.72e9 multiply-adds, as
    # the torchvision table (5.71 GFLOPS) and timm's card (5.7 GMACs) list.
    "InceptionV3": {"value": 5.72e9, "input": (299, 299, 3),
                    "source": "torchvision models table (inception_v3: 5.71 GFLOPS); "
                              "paper: ~5e9 (Szegedy et al. 2016, arXiv:1512.00567)"},
    # Huang et al., "Densely Connected Convolutional Networks", CVPR 2017, plot
    # DenseNet-121's ~2.9e9 FLOPs (Fig. 3) without a table; 2.87e9 is the commonly
    # cited figure (timm card: 2.9 GMACs; torchvision: 2.83 GFLOPS).
    "DenseNet121": {"value": 2.87e9, "input": (224, 224, 3),
                    "source": "Huang et al. 2017 (arXiv:1608.06993), Fig. 3; timm 2.9 GMACs"},
}

TOLERANCE = 0.05  # relative
