"""load_model: keras.applications names, zoo names, .keras files, module:function, errors."""

import keras
import pytest

from autodist_keras.errors import GraphError
from autodist_keras.graph import ModelGraph
from autodist_keras.graph import load_model
from autodist_keras.graph import zoo


def test_zoo_names_are_case_insensitive_and_take_options():
    model = load_model("MLP", input_dim=5, hidden=(7,), num_classes=3)
    assert model.name == "mlp"
    assert model.input_shape == (None, 5) and model.output_shape == (None, 3)
    encoder = load_model("transformer-encoder", num_layers=1, d_model=16, heads=2, seq_len=8,
                         vocab=50)
    types = [n.layer_type for n in ModelGraph.from_keras(encoder).nodes.values()]
    assert types.count("MultiHeadAttention") == 1


def test_application_names_ignore_case_and_underscores():
    model = load_model("mobilenet_v3_small", classes=7)
    assert model.name.lower().startswith("mobilenetv3small")
    # Without weights MobileNetV3 leaves the image size open; load_model fixes 224x224.
    assert model.input_shape == (None, 224, 224, 3)
    assert model.output_shape == (None, 7)
    graph = ModelGraph.from_keras(model)
    # Every layer type of this model has a formula (Rescaling, hard_sigmoid, ...).
    assert not graph.warnings and graph.params == model.count_params()


def test_weights_are_never_downloaded():
    with pytest.raises(GraphError, match="never downloads.*Received: weights='imagenet'"):
        load_model("ResNet50", weights="imagenet")


def test_keras_file_round_trip(tmp_path):
    keras.utils.set_random_seed(3)
    model = zoo.transformer_encoder(num_layers=1, d_model=16, heads=2, seq_len=8, vocab=50)
    path = tmp_path / "encoder.keras"
    model.save(path)
    loaded = load_model(str(path))
    before, after = ModelGraph.from_keras(model), ModelGraph.from_keras(loaded)
    assert after.fingerprint() == before.fingerprint()
    assert [v.name for v in after.variables] == [v.name for v in before.variables]
    for a, b in zip(model.weights, loaded.weights):
        assert keras.ops.all(a.value == b.value)


def test_module_function_spec(tmp_path, monkeypatch):
    (tmp_path / "my_models_for_test.py").write_text(
        "from autodist_keras.graph import zoo\n"
        "def build():\n"
        "    return zoo.mlp(input_dim=3, hidden=(4,), name='from_factory')\n"
        "def not_a_model():\n"
        "    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = load_model("my_models_for_test:build")
    assert model.name == "from_factory"
    with pytest.raises(GraphError, match="returned a int, not a keras.Model"):
        load_model("my_models_for_test:not_a_model")
    with pytest.raises(GraphError, match="has no attribute 'missing'"):
        load_model("my_models_for_test:missing")
    with pytest.raises(GraphError, match="Cannot import module 'no_such_module_xyz'"):
        load_model("no_such_module_xyz:build")


def test_empty_or_truncated_keras_files_are_named_for_what_they_are(tmp_path):
    """Keras says "File not found" for a file that exists but is empty or not a
    zip archive; load_model (and so the CLI) says what is wrong with it."""
    import re

    empty = tmp_path / "empty.keras"
    empty.write_bytes(b"")
    with pytest.raises(GraphError) as info:
        load_model(str(empty))
    text = str(info.value)
    assert "is empty (0 bytes)" in text and "not a valid .keras archive" in text
    assert "not found" not in text.lower()
    assert text.endswith(f"Received: {str(empty)!r}")
    # A real model's file cut short (an interrupted copy) is no zip archive any more.
    model = zoo.mlp(input_dim=4, hidden=(8,), name="to_truncate")
    saved = tmp_path / "saved.keras"
    model.save(saved)
    truncated = tmp_path / "truncated.keras"
    truncated.write_bytes(saved.read_bytes()[: saved.stat().st_size // 2])
    with pytest.raises(GraphError, match=re.escape(
            f"is not a valid .keras archive: a .keras file is a zip archive written by Keras 3, "
            f"and this one ({truncated.stat().st_size} bytes) is not a zip file")) as info:
        load_model(str(truncated))
    assert "not found" not in str(info.value).lower()
    assert str(info.value).endswith(f"Received: {str(truncated)!r}")
    assert load_model(str(saved)).name == "to_truncate"  # the whole file still loads
    # An empty legacy .h5 file too.
    empty_h5 = tmp_path / "empty.h5"
    empty_h5.write_bytes(b"")
    with pytest.raises(GraphError, match="is empty \\(0 bytes\\)"):
        load_model(str(empty_h5))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("ResNet5O", "Unknown model 'ResNet5O'.*Did you mean ResNet50"),
        ("definitely_not_a_model", "keras.applications name.*mlp, small_cnn"),
        ("missing_file.keras", "does not exist"),
        ("", "non-empty string"),
        (42, "Received: 42"),
    ],
)
def test_bad_specs_raise_graph_error_with_options(spec, message):
    with pytest.raises(GraphError, match=message) as info:
        load_model(spec)
    assert "Received" in str(info.value)


def test_model_passes_through():
    model = zoo.mlp()
    assert load_model(model) is model


def test_module_function_spec_from_the_working_directory_and_failing_builders(
        tmp_path, monkeypatch):
    """An installed console script does not search the working directory; a
    'module:function' spec finds a module there, as `python -m` would. A builder
    that raises gives a GraphError naming the spec."""
    import sys

    (tmp_path / "models_in_cwd_for_test.py").write_text(
        "from autodist_keras.graph import zoo\n"
        "def build():\n"
        "    return zoo.mlp(input_dim=3, hidden=(4,), name='from_cwd')\n"
        "def broken():\n"
        "    raise RuntimeError('no GPU config here')\n"
        "def lookup():\n"
        "    return {}['width']\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_model("models_in_cwd_for_test:build").name == "from_cwd"
    with pytest.raises(GraphError, match="'models_in_cwd_for_test:broken'.*RuntimeError\\("
                                         "'no GPU config here'\\)"):
        load_model("models_in_cwd_for_test:broken")
    # It said "raised KeyError: 'width'. Received: {}" (the options, none here).
    with pytest.raises(GraphError) as info:
        load_model("models_in_cwd_for_test:lookup")
    message = str(info.value)
    assert ("its function models_in_cwd_for_test.lookup() raised KeyError('width') at "
            f"{tmp_path / 'models_in_cwd_for_test.py'}:7.") in message, message
    assert message.endswith("Received: 'models_in_cwd_for_test:lookup'"), message
    assert isinstance(info.value.__cause__, KeyError)
