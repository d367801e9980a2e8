"""timm_odevit_tools: the tools around the library, installed with it (as ``open_clip_train`` sits beside
``open_clip``): the training command (``train``), the Hub export, verify, push and local mirror (``hub``), the
benchmark (``benchmark``), the Fashion-MNIST plumbing (``data``), evaluation (``evaluate``) and the zoo tables
(``zoo``). A timm user needs only ``timm_odevit``; these are for training, publishing and measuring. See
docs/layout.md."""
import timm_odevit  # noqa: F401  (every tool builds our models by name: register them first)
