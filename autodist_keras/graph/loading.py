"""`load_model(spec)`: a Keras model from a name, a file or a factory function.

Specs, tried in this order:

- a `keras.Model`: returned as is;
- a path to a `.keras` (or legacy `.h5`) file: loaded with
  `keras.saving.load_model(path, compile=False)` (safe mode on);
- `"module:function"`: the module is imported and the function is called
  with no arguments; it must return a `keras.Model`;
- a built-in zoo name: `"mlp"`, `"small_cnn"`, `"transformer_encoder"`,
  `"bert_large"` (see `autodist_keras.graph.zoo`);
- a `keras.applications` name, case-insensitive and ignoring `_`/`-`
  (`"ResNet50"`, `"resnet152"`, `"mobilenet_v2"`), built with
  `weights=None`: pretrained weights are never downloaded. A builder that
  leaves the image size open (MobileNetV3) is built at 224x224 unless
  `input_shape` is given.

Example:

```python
model = load_model("ResNet50")
model = load_model("transformer_encoder", num_layers=12, d_model=512)
model = load_model("my_package.models:build")
```
"""

import difflib
import importlib
import os
import sys
import zipfile

from autodist_keras.errors import GraphError

ZOO_NAMES = ("mlp", "small_cnn", "transformer_encoder", "bert_large")


def _normalise(name):
    return name.lower().replace("_", "").replace("-", "")


def application_names():
    """Names of the model builders in `keras.applications` (e.g. `"ResNet50"`)."""
    import keras

    return sorted(
        name for name in dir(keras.applications)
        if name[:1].isupper() and callable(getattr(keras.applications, name))
    )


def _options_text():
    return (
        "a keras.applications name (e.g. ResNet50, VGG16, MobileNetV2, InceptionV3, "
        "DenseNet121; built with weights=None), a built-in model "
        f"({', '.join(ZOO_NAMES)}), a path to a .keras file, or 'module:function' "
        "returning a keras.Model"
    )


def load_model(spec, **kwargs):
    """Returns the Keras model that `spec` names.

    Args:
        spec: A `keras.Model`, a `.keras` file path, `"module:function"`, a
            zoo name or a `keras.applications` name (see the module docs).
        **kwargs: Passed to the zoo builder or the `keras.applications`
            function (e.g. `num_layers=12`, `input_shape=(160, 160, 3)`).

    Returns:
        A `keras.Model` (not compiled).

    Raises:
        GraphError: If the spec names nothing loadable (the message lists
            the accepted forms and close matches), or names a model file
            that is missing, empty, not a valid .keras archive, or cannot
            be loaded.
    """
    import keras

    if isinstance(spec, keras.Model):
        return spec
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise GraphError(
            f"A model spec must be a non-empty string or a keras.Model: {_options_text()}. "
            f"Received: {spec!r}"
        )
    spec = spec.strip()
    lower = spec.lower()
    if lower.endswith((".keras", ".h5", ".hdf5")) or os.path.isfile(spec):
        return _load_file(spec, kwargs)
    if ":" in spec:
        return _load_factory(spec, kwargs)
    from autodist_keras.graph import zoo

    zoo_key = lower.replace("-", "_")
    if zoo_key in zoo.BUILDERS:
        return _call(zoo.BUILDERS[zoo_key], spec, kwargs)
    names = application_names()
    by_key = {_normalise(n): n for n in names}
    match = by_key.get(_normalise(spec))
    if match is not None:
        options = dict(kwargs)
        options.setdefault("weights", None)
        if options["weights"] is not None:
            raise GraphError(
                "load_model builds keras.applications models without pretrained weights "
                "(it never downloads). Load weights yourself after building. "
                f"Received: weights={options['weights']!r}"
            )
        model = _call(getattr(keras.applications, match), spec, options)
        if "input_shape" not in kwargs and any(d is None for d in model.input_shape[1:]):
            # Some builders (MobileNetV3) leave the spatial size open without
            # weights; costs need it, so rebuild at the ImageNet default.
            channels = model.input_shape[-1] or 3
            options["input_shape"] = (224, 224, channels)
            model = _call(getattr(keras.applications, match), spec, options)
        return model
    close = difflib.get_close_matches(
        _normalise(spec), list(by_key) + [_normalise(z) for z in ZOO_NAMES], n=3, cutoff=0.6
    )
    all_names = {**by_key, **{_normalise(z): z for z in ZOO_NAMES}}
    hint = f" Did you mean {', '.join(all_names[c] for c in close)}?" if close else ""
    raise GraphError(
        f"Unknown model {spec!r}. A model spec is {_options_text()}.{hint} "
        f"keras.applications offers: {', '.join(names)}. Received: {spec!r}"
    )


def _call(fn, spec, kwargs):
    """Calls the builder `fn(**kwargs)` of model spec `spec`.

    Args:
        fn: The builder (a zoo builder, a `keras.applications` function, or
            the function a `"module:function"` spec names).
        spec: The model spec, for the message.
        kwargs: The options passed to `fn`.

    Returns:
        What `fn` returned.

    Raises:
        GraphError: If `fn` raises; the message names the function, the
            line it raised at and the exception as `repr` shows it
            (`KeyError('x')`, not the bare `'x'` of `str`); the original is
            chained as its cause.

    Example:

    ```python
    _call(zoo.BUILDERS["mlp"], "mlp", {"hidden": (8,)})
    ```
    """
    try:
        model = fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - the user's builder may fail in any way
        import traceback

        from autodist_keras.errors import received_repr

        # (It said "raised KeyError: 'x'. Received: {}": the options, empty here.)
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
        module = getattr(fn, "__module__", None)
        function = f"{module}.{name}" if module and name else repr(fn)
        # Where it raised: the last line run in the function's own file (not deep in
        # Keras), else the last line run.
        frames = traceback.extract_tb(e.__traceback__)[1:]  # (not this function's call)
        code = getattr(fn, "__code__", None)
        own = [f for f in frames if code is not None and f.filename == code.co_filename]
        frame = (own or frames or [None])[-1]
        where = f" at {frame.filename}:{frame.lineno}" if frame is not None else ""
        options = f" with options {received_repr(kwargs)}" if kwargs else ""
        raise GraphError(
            f"Building model {spec!r}: its function {function}(){options} raised "
            f"{received_repr(e)}{where}. Fix the function (or the options given to it). "
            f"Received: {spec!r}{options}"
        ) from e
    return model


def _import_here_or_on_path(module_name):
    """Imports `module_name`, also from the working directory (as `python -m` does),
    which an installed console script does not search."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        if e.name != module_name.split(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.insert(0, here)
        try:
            return importlib.import_module(module_name)
        except ImportError:
            sys.path.remove(here)
            raise


def import_user_module(module_name):
    """Imports a module the user names (e.g. one registering custom layers).

    Args:
        module_name: A dotted module name, importable from `sys.path` or the
            working directory.

    Raises:
        GraphError: If it cannot be imported.
    """
    try:
        return _import_here_or_on_path(module_name)
    except ImportError as e:
        raise GraphError(
            f"Cannot import module {module_name!r}: {e}. Make it importable (install it, run "
            "from its folder, or add the folder to PYTHONPATH). "
            f"Received: {module_name!r}"
        ) from None


def _load_file(path, kwargs):
    import keras

    if not os.path.isfile(path):
        raise GraphError(
            f"Model file {path!r} does not exist. Give the path of a model saved with "
            f"`model.save('model.keras')`, or {_options_text()}. Received: {path!r}"
        )
    # Keras reports an empty or non-zip .keras file as "File not found": say what it is.
    resave = ("Save the model again with `model.save('model.keras')` (an interrupted save "
              "or copy leaves a truncated file) and pass that file.")
    if os.path.getsize(path) == 0:
        raise GraphError(
            f"Model file {path!r} is empty (0 bytes), so it is not a valid .keras archive or "
            f"saved model. {resave} Received: {path!r}"
        )
    if path.lower().endswith(".keras") and not zipfile.is_zipfile(path):
        raise GraphError(
            f"Model file {path!r} is not a valid .keras archive: a .keras file is a zip archive "
            f"written by Keras 3, and this one ({os.path.getsize(path)} bytes) is not a zip "
            f"file. {resave} A legacy HDF5 model needs the .h5 extension. Received: {path!r}"
        )
    # Models from the zoo use PositionEmbedding: register it before loading.
    from autodist_keras.graph import zoo  # noqa: F401

    try:
        return keras.saving.load_model(path, compile=False, **kwargs)
    except (ValueError, OSError, TypeError) as e:
        raise GraphError(
            f"Cannot load model file {path!r}: {type(e).__name__}: {e}. It must be a "
            "model saved by Keras 3 (`model.save('model.keras')`); custom layers must be "
            "registered with keras.saving.register_keras_serializable before loading (on the "
            "command line, `--import MODULE` imports the module that registers them). "
            f"Received: {path!r}"
        ) from None


def _load_factory(spec, kwargs):
    import keras

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise GraphError(
            f"A factory spec is 'module:function', e.g. 'my_models:build'. Received: {spec!r}"
        )
    try:
        module = _import_here_or_on_path(module_name)
    except ImportError as e:
        raise GraphError(
            f"Cannot import module {module_name!r} of model spec {spec!r}: {e}. Make the "
            "module importable (install it or add its folder to PYTHONPATH). "
            f"Received: {spec!r}"
        ) from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise GraphError(
                f"Module {module_name!r} has no attribute {attr!r}; the model spec "
                "'module:function' must name a function returning a keras.Model. "
                f"Received: {spec!r}"
            )
    if not callable(fn):
        raise GraphError(
            f"{spec!r} is not callable; 'module:function' must name a function returning "
            f"a keras.Model. Received: {type(fn).__name__}"
        )
    model = _call(fn, spec, kwargs)
    if not isinstance(model, keras.Model):
        raise GraphError(
            f"{spec!r} returned a {type(model).__name__}, not a keras.Model. Make the "
            f"function return the model. Received: {model!r:.200}"
        )
    return model
