"""The LDC step in ``torch_ref`` (PyTorch, eager and optionally ``torch.compile``), on the
same weights and points as the JAX step of :mod:`benchmarks.ldc`."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from benchmarks import ldc


def available() -> Optional[str]:
    """None when torch and torch_ref import; otherwise the reason they do not."""
    try:
        import torch  # noqa: F401

        import torch_ref  # noqa: F401
    except Exception as e:  # ImportError, or torch_ref still being written
        return f"{type(e).__name__}: {e}"
    return None


def build_torch_step(mode: str, size: ldc.LDCSize, params: Any, points: Dict[str, Any],
                     compile_model: bool = False) -> Tuple[Callable[[], Dict[str, Any]], Any]:
    """``(run, model)``: ``run()`` takes one torch_ref train step (Adam 1e-3, clip 0.5) in ``mode``.

    ``compile_model`` wraps the network in ``torch.compile`` (the derivative graph itself is
    built by autograd at run time, as Modulus does).
    """
    import torch

    import torch_ref

    torch.manual_seed(0)
    net_amp, engine_amp, step_amp, precision = ldc.mode_settings(mode)
    model = torch_ref.models.FullyConnected.from_amp(
        net_amp.to_dict(), 2, 3, layer_size=size.layer_size, nr_layers=size.nr_layers
    )
    model.load_state_dict(torch_ref.flax_to_torch(params))
    fn = torch.compile(model) if compile_model else model
    engine = torch_ref.Derivatives(
        fn, inputs=ldc.INPUTS, outputs=ldc.OUTPUTS, derivatives=ldc.DERIVATIVES, amp=engine_amp.to_dict()
    )
    batch = {k: torch.from_numpy(np.array(v)) for k, v in points.items()}
    batch["interior"].requires_grad_(True)

    def loss_fn(m, b, scales):
        d, found = engine(b["interior"], scales)
        res = ldc.residuals(d)
        lid, wall = fn(b["lid"]), fn(b["noslip"])
        terms = {k: torch.mean(r**2) for k, r in res.items()}
        terms["lid"] = torch.mean((lid[:, 0] - 1.0) ** 2 + lid[:, 1] ** 2)
        terms["noslip"] = torch.mean(wall[:, 0] ** 2 + wall[:, 1] ** 2)
        return sum(terms.values()), (terms, found)

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = torch_ref.TrainState.create(model=model, optimizer=opt, amp=step_amp.to_dict(), engines=[engine])
    step = torch_ref.make_train_step(loss_fn)
    if precision == "highest":
        torch.backends.cuda.matmul.allow_tf32 = False
    return (lambda: step(state, batch)), model
