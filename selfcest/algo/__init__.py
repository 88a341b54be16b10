"""The trainer's pure algorithms: advantages and credit (`advantages`), losses (`losses`).

Both modules work on plain objects (clone trees, floats, tensors) and hold no model, so
every formula can be checked by hand in a test.
"""
