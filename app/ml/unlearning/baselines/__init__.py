"""Baseline unlearning methods.

Registered here, once, by reference ("module:Class") so that reading the registry never imports torch; the modules
themselves register nothing.
"""

from app.ml.unlearning.base import register_method

_FEDERATED = {"clip_federated"}
_ALL_SCOPES = {"client", "class", "samples"}
_EXACT = {"fed_retrain"}  # federated retraining from θ₀ without the forget pairs: where ``auto`` escalates
_BASELINES = (
    ("sisa", "sisa:SISAConfig", "sisa:SISA", {"tabular"}, {"samples"}, True),
    ("fed_retrain", "fed_retrain:FedRetrainConfig", "fed_retrain:FedRetrain", _FEDERATED, _ALL_SCOPES, False),
    (
        "fed_gradient_ascent",
        "gradient_ascent:GradientAscentConfig",
        "gradient_ascent:GradientAscent",
        _FEDERATED,
        _ALL_SCOPES,
        False,
    ),
    ("federaser", "federaser:FedEraserConfig", "federaser:FedEraser", _FEDERATED, _ALL_SCOPES, False),
    ("fedosd", "fedosd:FedOSDConfig", "fedosd:FedOSD", _FEDERATED, _ALL_SCOPES, False),
)
for _name, _config, _method, _kinds, _scopes, _prepared in _BASELINES:
    register_method(
        _name,
        f"{__name__}.{_config}",
        f"{__name__}.{_method}",
        model_kinds=_kinds,
        scopes=_scopes,
        needs_preparation=_prepared,
        exact=_name in _EXACT,
    )
