"""The adaptive depth (``n_max="auto"``): the measured cost model, the depth policy and the adaptive step."""
