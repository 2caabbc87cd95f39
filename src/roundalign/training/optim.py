"""FP32 master weights for a bf16 (or fp16) policy: the optimizer steps fp32 copies, the model keeps low precision.

The study is about how the bf16 model rounds, so the trainer's forward and backward must be exactly the bf16
model's (what vLLM runs after each weight sync): no autocast, which would move rounding points. Stepping the
bf16 weights themselves loses most updates (at lr 1e-6, 10 AdamW steps changed 1.9% of N(0, 0.02) bf16
weights, 99.99% of fp32 ones; norm weights near 1.0 never changed). ``MasterWeightsOptimizer`` does what
DeepSpeed's bf16 optimizer and Megatron do on one device:

- every trainable low-precision parameter ``p`` gets an fp32 master copy; the wrapped optimizer (TRL's
  AdamW with Trainer's weight-decay groups, built as usual) holds the masters and fp32 state;
- gradients flow into ``p.grad`` (low precision, one micro-batch) and are moved into ``master.grad`` in
  fp32 as soon as autograd accumulated them (a post-accumulate-grad hook), so gradient accumulation over
  micro-batches happens in fp32. Under DDP (whose reducer owns ``p.grad`` until it has averaged it) they
  are moved at clip/step time instead;
- ``clip_master_grads`` clips the fp32 master gradients (the Trainer's clipping hook calls it);
- after ``step`` each ``p`` is set to ``master`` rounded to its dtype (round to nearest even), so the model
  (and the engine, which copies the model) always holds exactly ``master.to(bf16)``;
- ``state_dict`` carries the masters with the optimizer state: a resumed run continues from the same fp32
  values, not from the rounded ones in the model checkpoint;
- ``loss_scale`` (fp16): dynamic loss scaling like ``torch.amp.GradScaler`` (start 2^16, halve and skip the
  step on inf/NaN gradients, double after ``growth_interval`` clean steps). The scale is applied to the
  gradient only (``scale_loss_grad``), so the logged loss is unchanged.
"""

from __future__ import annotations

import torch

__all__ = ["MasterWeightsOptimizer", "scale_loss_grad"]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the incoming gradient by ``scale`` (the loss value is not changed)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_loss_grad(loss: torch.Tensor, scale: float) -> torch.Tensor:
    return loss if scale == 1.0 else _ScaleGrad.apply(loss, scale)


class MasterWeightsOptimizer(torch.optim.Optimizer):
    """Wraps ``inner`` (built over the model's low-precision parameters) so it steps fp32 master copies.

    Args:
        inner: a fresh optimizer (no state yet) over the model's parameters; its parameter groups are kept
            (lr, weight decay, betas) with each low-precision parameter replaced by its fp32 master.
        hooks: move gradients into the masters as autograd accumulates them (fp32 accumulation). Off under
            DDP, whose reducer reads ``p.grad`` after the backward.
        dynamic_loss_scale: fp16: scale gradients dynamically (see module docstring); bf16 needs none.
    """

    def __init__(self, inner: torch.optim.Optimizer, *, hooks: bool = True, dynamic_loss_scale: bool = False,
                 init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        if inner.state:
            raise ValueError("MasterWeightsOptimizer needs a fresh optimizer (its state is keyed by parameter)")
        self.inner = inner
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # (model param, fp32 master)
        for group in inner.param_groups:
            masters = []
            for p in group["params"]:
                if p.dtype == torch.float32:
                    masters.append(p)  # already fp32: it is its own master
                    continue
                m = p.detach().clone().float().requires_grad_(p.requires_grad)
                self.pairs.append((p, m))
                masters.append(m)
            group["params"] = masters
        self.dynamic = dynamic_loss_scale
        self.loss_scale = float(init_scale) if dynamic_loss_scale else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.overflow = False
        self.skipped_steps = 0
        self._prepared = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._move_grad) for p, _ in self.pairs] if hooks else []
        self._master_of = {id(p): m for p, m in self.pairs}
        # torch.optim.Optimizer API surface the Trainer, accelerate and LR schedulers use
        self.defaults = inner.defaults

    # -- the Optimizer surface -----------------------------------------------------------------------

    @property
    def param_groups(self):
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups):
        self.inner.param_groups = groups

    @property
    def state(self):
        return self.inner.state

    @state.setter
    def state(self, state):
        self.inner.state = state

    def add_param_group(self, group):
        raise NotImplementedError("MasterWeightsOptimizer: build the inner optimizer with every parameter group")

    def __repr__(self):
        return f"MasterWeightsOptimizer(fp32 masters for {len(self.pairs)} tensors, {self.inner!r})"

    # -- gradients ------------------------------------------------------------------------------------

    @torch.no_grad()
    def _move_grad(self, p: torch.Tensor) -> None:
        m = self._master_of[id(p)]
        g = p.grad.float()
        if m.grad is None:
            m.grad = g
        else:
            m.grad.add_(g)
        p.grad = None

    @torch.no_grad()
    def _prepare_grads(self) -> None:
        """Move any gradient left on the model into the masters, unscale, and check for inf/NaN (fp16)."""
        if self._prepared:
            return
        for p, _ in self.pairs:
            if p.grad is not None:
                self._move_grad(p)
        grads = [m.grad for _, m in self.pairs if m.grad is not None]
        if self.loss_scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.loss_scale)
        self.overflow = self.dynamic and any(not torch.isfinite(g).all() for g in grads)
        self._prepared = True

    def master_params(self):
        return [p for group in self.inner.param_groups for p in group["params"]]

    @torch.no_grad()
    def clip_master_grads(self, max_norm: float) -> torch.Tensor:
        """Clip the fp32 master gradients to global L2 norm ``max_norm``; returns the norm before clipping
        (inf/NaN on an fp16 overflow step, which ``step`` then skips)."""
        self._prepare_grads()
        params = [p for p in self.master_params() if p.grad is not None]
        if not params:
            return torch.zeros(())
        if self.overflow:
            return torch.tensor(float("inf"))
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, m in self.pairs:
            p.grad = None
            m.grad = None
        self.inner.zero_grad(set_to_none=True)
        self._prepared = False

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeightsOptimizer does not support closures")
        self._prepare_grads()
        if self.overflow:
            self.loss_scale = max(self.loss_scale / 2.0, 1.0)
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.inner.step()
            if self.dynamic:
                self.good_steps += 1
                if self.good_steps >= self.growth_interval:
                    self.loss_scale *= 2.0
                    self.good_steps = 0
        self.zero_grad()
        self.copy_masters_to_model()

    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        for p, m in self.pairs:
            p.copy_(m)  # fp32 -> bf16/fp16, round to nearest even

    # -- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "masters": [m.detach().clone() for _, m in self.pairs],
                "loss_scale": self.loss_scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        masters = state["masters"]
        if len(masters) != len(self.pairs):
            raise ValueError(f"checkpoint holds {len(masters)} master tensors, this model has {len(self.pairs)}")
        for (_, m), saved in zip(self.pairs, masters):
            m.copy_(saved)
        self.loss_scale = float(state.get("loss_scale", self.loss_scale))
        self.good_steps = int(state.get("good_steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.copy_masters_to_model()

    def master_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with every low-precision parameter replaced by its fp32 master (tied
        weights appear under each of their names)."""
        by_param = {id(p): m for p, m in self.pairs}
        out = {}
        for name, t in model.state_dict(keep_vars=True).items():
            m = by_param.get(id(t))
            out[name] = (m if m is not None else t).detach().float().clone() if t.is_floating_point() \
                else t.detach().clone()
        return out
