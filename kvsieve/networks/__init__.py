"""The networks policies run and the checkpoints they load: DistillCache's keep network (``keep_net``, its
features ``keep_features``), KVzap's surrogate network (``kvzap_net``), checkpoint files (``checkpoint``), the
model a checkpoint is tied to (``model_shape``, ``fingerprint``) and the shipped checkpoints (``shipped``).
Training lives above, in :mod:`kvsieve.learn`; the policies that read these, in :mod:`kvsieve.policies`."""
