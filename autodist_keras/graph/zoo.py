"""Built-in model builders for demos, tests and benchmarks (no downloads).

Each builder returns an uncompiled Functional `keras.Model` made of stock
Keras layers (plus `PositionEmbedding`, defined here). Defaults are small so
runtime tests stay fast; the weights are deterministic after
`keras.utils.set_random_seed(seed)`.

Example:

```python
keras.utils.set_random_seed(0)
model = zoo.transformer_encoder(num_layers=12, d_model=512, heads=8, seq_len=128, vocab=30000)
```
"""

import keras

from autodist_keras.graph import flops as flops_lib


@keras.saving.register_keras_serializable(package="autodist_keras")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned position embedding to a `(batch, seq_len, d_model)` input.

    The input's sequence length must equal `seq_len`.

    Args:
        seq_len: Maximum sequence length.
        initializer: Initializer of the `(seq_len, d_model)` table.
        **kwargs: Layer arguments (`name`, `dtype`, ...).
    """

    def __init__(self, seq_len, initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        self.seq_len = int(seq_len)
        self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            name="embeddings", shape=(self.seq_len, int(input_shape[-1])),
            initializer=self.initializer,
        )

    def call(self, inputs):
        return inputs + keras.ops.cast(self.embeddings, inputs.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            seq_len=self.seq_len, initializer=keras.initializers.serialize(self.initializer)
        )
        return config


@flops_lib.register_formula(PositionEmbedding)
def _position_embedding_cost(layer, call):
    n = flops_lib.elements(call.outputs[0])
    return flops_lib.Cost(flops=float(n))


def mlp(input_dim=32, hidden=(64, 64), num_classes=10, activation="relu", name="mlp"):
    """A multi-layer perceptron.

    Args:
        input_dim: Number of input features.
        hidden: Units of the hidden Dense layers.
        num_classes: Units of the output layer (logits, no activation).
        activation: Hidden-layer activation.
        name: Model name (layer names derive from it).

    Returns:
        A `keras.Model` taking `(batch, input_dim)` float32 inputs.
    """
    inputs = keras.Input((input_dim,), name=f"{name}_input")
    x = inputs
    for i, units in enumerate(hidden):
        x = keras.layers.Dense(units, activation=activation, name=f"{name}_dense{i}")(x)
    outputs = keras.layers.Dense(num_classes, name=f"{name}_logits")(x)
    return keras.Model(inputs, outputs, name=name)


def small_cnn(input_shape=(32, 32, 3), filters=(16, 32), num_classes=10, name="small_cnn"):
    """A small CNN: [Conv2D, BatchNormalization, ReLU, MaxPooling2D] blocks and a Dense head.

    Args:
        input_shape: Per-sample input shape, channels last.
        filters: Filters of each convolution block.
        num_classes: Units of the output layer (logits).
        name: Model name.

    Returns:
        A `keras.Model`.
    """
    inputs = keras.Input(input_shape, name=f"{name}_input")
    x = inputs
    for i, f in enumerate(filters):
        x = keras.layers.Conv2D(f, 3, padding="same", use_bias=False, name=f"{name}_conv{i}")(x)
        x = keras.layers.BatchNormalization(name=f"{name}_bn{i}")(x)
        x = keras.layers.ReLU(name=f"{name}_relu{i}")(x)
        x = keras.layers.MaxPooling2D(2, name=f"{name}_pool{i}")(x)
    x = keras.layers.GlobalAveragePooling2D(name=f"{name}_gap")(x)
    outputs = keras.layers.Dense(num_classes, name=f"{name}_logits")(x)
    return keras.Model(inputs, outputs, name=name)


def transformer_encoder(
    num_layers=2,
    d_model=64,
    heads=4,
    seq_len=32,
    vocab=1000,
    ff_dim=None,
    num_classes=2,
    dropout=0.0,
    initializer="glorot_uniform",
    name="transformer_encoder",
):
    """A post-norm Transformer encoder classifier built from Keras layers.

    Token and position embeddings, `num_layers` blocks of
    [MultiHeadAttention, Add, LayerNormalization, Dense(ff_dim, gelu),
    Dense(d_model), Add, LayerNormalization], then mean pooling and a
    Dense head.

    Args:
        num_layers: Number of encoder blocks.
        d_model: Hidden size.
        heads: Attention heads (`d_model` must divide by it).
        seq_len: Sequence length of the int32 token input.
        vocab: Vocabulary size.
        ff_dim: Feed-forward size (default `4 * d_model`).
        num_classes: Units of the output layer (logits).
        dropout: Dropout rate; 0 adds no Dropout layers (the default, so
            distributed and single-device runs give the same gradients).
        initializer: Kernel and embedding initializer.
        name: Model name.

    Returns:
        A `keras.Model` taking `(batch, seq_len)` int32 token ids.
    """
    if d_model % heads:
        raise ValueError(
            f"d_model must be divisible by heads. Received: d_model={d_model}, heads={heads}"
        )
    ff_dim = ff_dim or 4 * d_model
    inputs = keras.Input((seq_len,), dtype="int32", name=f"{name}_tokens")
    x = keras.layers.Embedding(vocab, d_model, embeddings_initializer=initializer,
                               name=f"{name}_token_embedding")(inputs)
    x = PositionEmbedding(seq_len, initializer=initializer, name=f"{name}_position_embedding")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, name=f"{name}_embedding_dropout")(x)
    for i in range(num_layers):
        p = f"{name}_block{i}"
        attention = keras.layers.MultiHeadAttention(
            heads, d_model // heads, dropout=dropout, kernel_initializer=initializer,
            name=f"{p}_attention",
        )(x, x)
        if dropout:
            attention = keras.layers.Dropout(dropout, name=f"{p}_attention_dropout")(attention)
        x = keras.layers.Add(name=f"{p}_attention_add")([x, attention])
        x = keras.layers.LayerNormalization(epsilon=1e-6, name=f"{p}_attention_norm")(x)
        h = keras.layers.Dense(ff_dim, activation="gelu", kernel_initializer=initializer,
                               name=f"{p}_ff1")(x)
        h = keras.layers.Dense(d_model, kernel_initializer=initializer, name=f"{p}_ff2")(h)
        if dropout:
            h = keras.layers.Dropout(dropout, name=f"{p}_ff_dropout")(h)
        x = keras.layers.Add(name=f"{p}_ff_add")([x, h])
        x = keras.layers.LayerNormalization(epsilon=1e-6, name=f"{p}_ff_norm")(x)
    x = keras.layers.GlobalAveragePooling1D(name=f"{name}_pool")(x)
    outputs = keras.layers.Dense(num_classes, kernel_initializer=initializer,
                                 name=f"{name}_logits")(x)
    return keras.Model(inputs, outputs, name=name)


def bert_large(seq_len=512, vocab=30522, num_classes=2, dropout=0.1,
               initializer="zeros", name="bert_large"):
    """BERT-large-shaped encoder: 24 blocks, d_model 1024, 16 heads, ff 4096.

    For planning and graph benchmarks (334M parameters, about 1.3 GB of
    float32 weights). The default `initializer="zeros"` makes building fast;
    pass `"glorot_uniform"` to train it.

    Args:
        seq_len: Sequence length.
        vocab: Vocabulary size.
        num_classes: Units of the output layer.
        dropout: Dropout rate.
        initializer: Kernel and embedding initializer.
        name: Model name.

    Returns:
        A `keras.Model`.
    """
    return transformer_encoder(
        num_layers=24, d_model=1024, heads=16, seq_len=seq_len, vocab=vocab, ff_dim=4096,
        num_classes=num_classes, dropout=dropout, initializer=initializer, name=name,
    )


BUILDERS = {
    "mlp": mlp,
    "small_cnn": small_cnn,
    "transformer_encoder": transformer_encoder,
    "bert_large": bert_large,
}
