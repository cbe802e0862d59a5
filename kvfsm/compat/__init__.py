"""Drop-in replacements for other servers' KV-transfer classes, built on kvfsm.

`kvfsm.compat.sglang` mirrors SGLang's `disaggregation/base/conn.py`
interface (`KVManager`, `KVSender`, `KVReceiver` and the fake warmup
backend) so a server swaps the classes in without edits, while every
status it reads comes from a kvfsm state machine. Nothing here imports the
server's own package: the interfaces are matched, not inherited.
"""

__all__ = ["sglang"]
