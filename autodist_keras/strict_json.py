"""Standard JSON text: NaN and Infinity refused with a message naming the field.

Python's `json` writes a non-finite float as the bare word `NaN` or
`Infinity`, which JavaScript's `JSON.parse`, `jq` and other strict readers
reject. Every JSON file and `--json` output of the package goes through
`dumps`, so a non-finite number is caught where it is written, named by its
field, instead of breaking whoever reads the file later.
"""

import json
import math


def non_finite_field(value, field=""):
    """The first NaN or infinite float in `value`, or None.

    Args:
        value: A JSON-able value (dicts, lists, tuples, numbers, strings).
        field: The dotted path of `value` itself, for the result.

    Returns:
        `(dotted path, value)` (e.g. `("prediction.step_time_s", nan)`), or
        None when every float is finite.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return field or "<top level>", value
    if isinstance(value, dict):
        items = ((f"{field}.{k}" if field else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{field}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for path, item in items:
        found = non_finite_field(item, path)
        if found is not None:
            return found
    return None


def dumps(data, where, error_type, indent=None, sort_keys=True):
    """`data` as standard JSON text (RFC 8259), refusing NaN and Infinity.

    Args:
        data: A JSON-able value.
        where: What is being written (a file, "the plan"), for the message.
        error_type: The package exception to raise (`PlanError`,
            `EstimatorError`, ...).
        indent: As for `json.dumps`.
        sort_keys: As for `json.dumps`.

    Returns:
        The JSON text.

    Raises:
        error_type: If `data` holds a NaN or infinite float (naming its
            field), or a value or structure JSON cannot hold.

    Example:

    >>> dumps({"a": 1.5}, "the plan", ValueError)
    '{"a": 1.5}'
    """
    try:
        return json.dumps(data, indent=indent, sort_keys=sort_keys, allow_nan=False)
    except (TypeError, ValueError) as e:
        found = non_finite_field(data)
        if found is None:  # a value JSON has no form for, or a circular reference
            raise error_type(
                f"Cannot write {where}: its data has no JSON form ({e}). Pass numbers, "
                f"strings, lists and dicts only. Received: {type(e).__name__}: {e}"
            ) from None
        field, value = found
        raise error_type(
            f"Cannot write {where}: field `{field}` is {value!r}, which standard JSON "
            "cannot hold (strict readers such as JavaScript's JSON.parse reject NaN and "
            "Infinity). Store None (null) or a finite number there. "
            f"Received: {field}={value!r}"
        ) from None
