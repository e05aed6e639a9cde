"""Whether a committed fixture is what its torch script writes now (the `torch` tests).

Where a fixture keeps its weights in a file of their own (safetensors), the callers compare
them bit for bit. Its arrays are compared here, and they are mostly float32 model outputs:
another torch or transformers release, or another CPU kind, orders some sums differently,
and after a few layers that moves them by a few float32 ulps (up to 4.3e-6 on logits of
magnitude 3, torch 2.14.1 against the fixtures' own run). So they are compared within float32
rounding, OUTPUT_TOLERANCE (1e-5 absolute, the bound the encoder and DETR checks already had);
a change to a script moves them by orders of magnitude more.
"""
from typing import Mapping

import numpy as np

OUTPUT_TOLERANCE = dict(rtol=0, atol=1e-5)


def assert_outputs_regenerate(committed, fresh: Mapping[str, np.ndarray], label: str = "") -> None:
    """The committed npz file holds exactly `fresh`'s arrays, within float32 rounding; string
    arrays (configs) exactly. `label` prefixes the failure message."""
    assert sorted(committed.files) == sorted(fresh), label
    for key, array in fresh.items():
        if array.dtype.kind in "US":
            np.testing.assert_array_equal(committed[key], array, err_msg=label + key)
        else:
            np.testing.assert_allclose(committed[key], array, err_msg=label + key,
                                       **OUTPUT_TOLERANCE)
