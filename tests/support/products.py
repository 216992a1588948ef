"""`ProductLog`: every matrix product a forward runs, at the aten level (after autocast and the
plan's routing), with the operands' dtypes and the modules that were running it; `outside_plan`
checks each ran inside a planned layer in that layer's planned format."""

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

# aten matrix products (and the fused attention kernels, which multiply matrices inside; not the
# vector ``dot`` that statistics hooks run) -> the positions of their matrix operands; an
# addmm-like op's first argument is the bias.
_OPERANDS = {
    "mm": (0, 1), "bmm": (0, 1), "mv": (0, 1), "_int_mm": (0, 1), "_scaled_mm": (0, 1),
    "addmm": (1, 2), "baddbmm": (1, 2), "addbmm": (1, 2), "addmv": (1, 2), "convolution": (0, 1),
    "_grouped_mm": (0, 1),  # a mixture of experts' grouped GEMM
}
_ATTENTION_PREFIX = "_scaled_dot_product_"  # _scaled_dot_product_flash_attention_for_cpu, ...
_DTYPES = {"fp32": {torch.float32}, "bf16": {torch.bfloat16}, "fp16": {torch.float16}}
_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}


@dataclass(frozen=True)
class Product:
    op: str
    dtypes: tuple
    modules: tuple  # fqns of the modules running, outermost first


class ProductLog(TorchDispatchMode):
    """``with ProductLog(model) as log: model(x)``: ``log.products`` lists every aten matrix
    product run inside, with the stack of ``model``'s modules (forward hooks) running it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.products: list[Product] = []
        self._stack: list[str] = []
        self._hooks = contextlib.ExitStack()

    def __enter__(self):
        for fqn, module in self.model.named_modules():
            self._hooks.enter_context(module.register_forward_pre_hook(lambda m, a, fqn=fqn: self._stack.append(fqn)))
            self._hooks.enter_context(module.register_forward_hook(self._leave, always_call=True))
        return super().__enter__()

    def __exit__(self, *exc):
        self._hooks.close()
        return super().__exit__(*exc)

    def _leave(self, module, args, output) -> None:
        self._stack.pop()  # returns None: a forward hook's return value would replace the output

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        positions = _OPERANDS.get(name, (0, 1, 2) if name.startswith(_ATTENTION_PREFIX) else None)
        if positions is not None:
            dtypes = tuple(args[i].dtype for i in positions if i < len(args) and torch.is_tensor(args[i]))
            self.products.append(Product(name, dtypes, tuple(self._stack)))
        return func(*args, **(kwargs or {}))

    def outside_plan(self, formats: dict, emulated: set) -> list[str]:
        """The products that did not run in the innermost planned layer running them, in its
        format. ``formats``: planned layer fqn -> format name; ``emulated``: the FP8 / INT8 layers
        the runtime reported emulating (FP32 compute on values rounded to the format)."""
        bad = []
        for p in self.products:
            layer = next((fqn for fqn in reversed(p.modules) if fqn in formats), None)
            if layer is None:
                bad.append(f"{p.op} {p.dtypes} outside every planned layer (in {p.modules[-1:] or 'no module'})")
                continue
            fmt = formats[layer]
            if fmt in _DTYPES:
                ok = set(p.dtypes) <= _DTYPES[fmt]
            elif fmt.startswith("fp8"):
                ok = (p.op == "_scaled_mm" and set(p.dtypes) <= _FP8) or (layer in emulated and set(p.dtypes) <= {torch.float32})
            else:  # int8
                ok = (p.op == "_int_mm" and set(p.dtypes) == {torch.int8}) or (layer in emulated and set(p.dtypes) <= {torch.float32})
            if not ok:
                bad.append(f"{p.op} {p.dtypes} in {layer!r}, planned {fmt}")
        return bad
