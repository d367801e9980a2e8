"""The experiments behind the README's results: the matched-budget study, teacher-guidance comparisons, solver
elasticity and the tables of the published weights. Not installed: run from a checkout's root
(``python -m experiments.study ...``, ``python -m experiments.weights ...``); they use the library (``timm_odevit``)
and the tools (``timm_odevit_tools``) as any user would. See docs/layout.md."""
