"""egraph-compiler: a rule-driven optimising compiler for PyTorch built on
equality saturation.  See README.md for the pipeline."""
from .api import CompiledFunction, compile, dynamo_backend, explain, last_compiled, last_plans
from .alternatives import alternatives
from .errors import (CalibrationWarning, CaptureError, CodegenError, EagerFallbackWarning, EgraphCompilerError, InputError, OptionError,
                     RuleError, ScalarMathWarning, UnsoundRuleError, UnsupportedOpError)

__all__ = ["compile", "explain", "alternatives", "dynamo_backend", "last_plans", "last_compiled", "CompiledFunction", "EgraphCompilerError", "CaptureError",
           "CodegenError", "InputError", "OptionError", "RuleError", "UnsoundRuleError", "UnsupportedOpError",
           "EagerFallbackWarning", "ScalarMathWarning", "CalibrationWarning"]
