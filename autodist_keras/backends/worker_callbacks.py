"""Keeps the file-writing callbacks of workers other than worker 0 off worker 0's files.

In a multi-worker run (TensorFlow with `TF_CONFIG`) every worker runs the
user's unchanged script, callbacks included, so two workers wrote the same
checkpoint at once: h5py refused the second lock and the job died, or a
`.keras` file came out corrupt. As `tf.keras` did for `MultiWorkerMirroredStrategy`,
worker 0 writes the files the script names, and the other workers write
theirs into a private scratch directory (`ModelCheckpoint`, `CSVLogger`,
`TensorBoard`). `BackupAndRestore` on the other workers restores from the
script's `backup_dir` (which every worker must be able to read: a shared
filesystem, or one machine) but neither writes nor deletes it, not even to
recover a damaged backup from its `.bkp` copy (it loads a private copy of
that instead). Callbacks of
other types run unchanged.

Example:

```python
callbacks = for_worker(callbacks, rank=1, scratch="/tmp/autodist_keras_worker1_x")
```
"""

import copy
import os


def _into(scratch, path, default):
    """`path`'s file name inside `scratch`."""
    return os.path.join(scratch, os.path.basename(os.fspath(path).rstrip("/\\")) or default)


def for_worker(callbacks, rank, scratch):
    """The callbacks a worker other than worker 0 runs.

    Args:
        callbacks: The `fit` call's callbacks (a list; not changed).
        rank: This worker's rank (> 0).
        scratch: A directory private to this worker.

    Returns:
        A new list: copies of the file-writing callbacks pointed at `scratch`
        (or, for `BackupAndRestore`, kept from writing), the others as given.
    """
    import keras

    out = []
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.ModelCheckpoint):
            callback = copy.copy(callback)
            callback.filepath = _into(scratch, callback.filepath, "checkpoint.keras")
        elif isinstance(callback, keras.callbacks.CSVLogger):
            callback = copy.copy(callback)
            callback.filename = _into(scratch, callback.filename, "log.csv")
        elif isinstance(callback, keras.callbacks.TensorBoard):
            callback = copy.copy(callback)
            callback.log_dir = os.path.join(scratch, f"tensorboard_worker{rank}")
        elif isinstance(callback, keras.callbacks.BackupAndRestore):
            callback = copy.copy(callback)
            callback._save_model = lambda: None  # worker 0 writes the backup
            callback.on_train_end = lambda logs=None: None  # and deletes it
            callback.on_train_begin = _restore_without_writing(callback, scratch)
        out.append(callback)
    return out


def _restore_without_writing(callback, scratch):
    """`BackupAndRestore.on_train_begin` that recovers a damaged backup without writing it.

    Keras's own method, when the latest weights cannot be read, copies the
    `.bkp` files over them (and may delete the metadata) before loading.
    Worker 0 does that; this worker copies the `.bkp` files into its private
    `scratch` directory instead (Keras loads weights only from files named
    `.weights.h5`) and loads them from there.
    """
    from keras.src.utils import file_utils  # as Keras reads backup_dir (local or remote)

    def on_train_begin(logs=None):
        try:
            callback._load_model()
            return
        except OSError:
            if not file_utils.exists(callback._prev_weights_path):
                raise
        restore = os.path.join(scratch, "backup_restore")
        os.makedirs(restore, exist_ok=True)
        latest = (callback._weights_path, callback._training_metadata_path)
        callback._weights_path = os.path.join(restore, "latest.weights.h5")
        file_utils.copy(callback._prev_weights_path, callback._weights_path)
        callback._training_metadata_path = os.path.join(restore, "training_metadata.json")
        if file_utils.exists(callback._prev_training_metadata_path):
            file_utils.copy(callback._prev_training_metadata_path,
                            callback._training_metadata_path)
        elif os.path.exists(callback._training_metadata_path):
            os.remove(callback._training_metadata_path)
        try:
            callback._load_model()
        finally:
            callback._weights_path, callback._training_metadata_path = latest

    return on_train_begin
