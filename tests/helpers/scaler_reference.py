"""A plain-Python transcription of docs/algorithm.md's "Scale update" rule (float32 arithmetic via numpy)."""

import numpy as np


def reference_update(scale, tracker, found_inf, *, growth_factor, backoff_factor, growth_interval,
                     max_scale, recover_threshold, recover_growth_interval, min_scale=None):
    scale = np.float32(scale)
    if found_inf:
        floor = 2.0**-126 if min_scale is None else max(min_scale, 2.0**-126)
        scale = max(np.float32(scale * np.float32(backoff_factor)), np.float32(floor))
        return scale, 0
    n = tracker + 1
    interval = recover_growth_interval if scale <= np.float32(recover_threshold) else growth_interval
    if n == interval:
        return min(np.float32(scale * np.float32(growth_factor)), np.float32(max_scale)), 0
    return scale, n
