"""The replicas' state checks (docs/recovery.md): ``fingerprint`` (the state digest), ``verifier``
(when ranks compare), ``replica_check`` (the comparison through the store), ``consistency``
(every rank loaded the same step).
"""
