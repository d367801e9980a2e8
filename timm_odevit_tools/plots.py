"""matplotlib for the tools' and experiments' figures: an optional dependency (``pip install 'timm_odevit[tools]'``)."""
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files only (the Agg backend: no display needed), or an ImportError that says
    how to install it."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("The figures need matplotlib, an optional dependency of timm_odevit: "
                          "pip install 'timm_odevit[tools]' (or pip install matplotlib).") from e
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt
