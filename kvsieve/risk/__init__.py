"""Risk control: certify a retention operating point with a finite-sample guarantee, else full KV.

Flow: results store -> :func:`loss_table` (per-request losses vs full KV) -> :func:`certify` or
:func:`certify_buckets` (p-values + multiple testing) -> :class:`ContractFile` (JSON) ->
:class:`CertifiedPolicy` at run time, which picks a request's
:class:`~kvsieve.policies.operating_point.OperatingPoint`. Nothing here loads a model.
"""

from kvsieve.risk.certify import (
    CandidateResult,
    Certification,
    Contract,
    InsufficientCalibrationError,
    certify,
    empirical_threshold,
)
from kvsieve.risk.contract import ContractFile, certify_buckets
from kvsieve.risk.losses import LossTable, candidate_losses, loss_table
from kvsieve.risk.runtime import CertifiedPolicy

__all__ = ["CandidateResult", "Certification", "CertifiedPolicy", "Contract", "ContractFile",
           "InsufficientCalibrationError", "LossTable", "candidate_losses", "certify",
           "certify_buckets", "empirical_threshold", "loss_table"]
