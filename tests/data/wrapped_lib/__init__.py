"""A small library whose functions are marked with `torch.fx.wrap`, as torchvision's are
(`torchvision.ops.stochastic_depth`, Swin's `shifted_window_attention`): fx records a call to
each as one node instead of tracing into it. Like `torchvision.ops`, the package re-exports
`scale` under the name of its module, so `wrapped_lib.scale` is the function, not the module
(a stage file must import it with `from wrapped_lib.scale import scale`)."""
from wrapped_lib.attention import WindowAttention, window_attention
from wrapped_lib.scale import LayerScale, scale

__all__ = ["LayerScale", "WindowAttention", "scale", "window_attention"]
