"""A TorchFunctionMode that is on only while chosen modules run: the way two techniques
intercept a torch call inside one layer without patching anything.

ContextParallel routes each `scaled_dot_product_attention` call of its attention layers to a
context-parallel core; selective recompute (recompute.py) runs each attention core of its
layers under torch.utils.checkpoint. Both need the same switch: a forward pre-hook of the layer
enters the mode, its forward hook leaves it, and a layer nested in another hooked one enters it
once (`depth`), so the mode sees every torch call made while the outermost hooked layer runs and
none made outside it. A subclass writes `__torch_function__` (what to do with the calls).

    mode = MyMode()
    layer.register_forward_pre_hook(mode.enter)
    layer.register_forward_hook(mode.exit, always_call=True)   # left even when forward raises
"""
from torch.overrides import TorchFunctionMode


class ModuleScopedMode(TorchFunctionMode):
    """A TorchFunctionMode switched on by a module's forward pre-hook (`enter`) and off by its
    forward hook (`exit`); nested hooked modules enter it once (`depth`)."""

    depth = 0

    def enter(self, *_):
        self.depth += 1
        if self.depth == 1:
            self.__enter__()

    def exit(self, *_):
        self.depth -= 1
        if self.depth == 0:
            self.__exit__(None, None, None)
