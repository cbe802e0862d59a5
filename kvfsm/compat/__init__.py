"""Drop-in replacements for other servers' KV-transfer classes, built on kvfsm.

`kvfsm.compat.sglang` mirrors SGLang's `disaggregation/base/conn.py`
interface (`KVManager`, `KVSender`, `KVReceiver` and the fake warmup
backend) so a server swaps the classes in without edits, while every
status it reads comes from a kvfsm state machine. Nothing there imports
SGLang: the interfaces are matched, not inherited.

`kvfsm.compat.vllm` is a vLLM (v1) KV connector, `KVFSMConnector`, which
does subclass vLLM's connector base; vLLM is imported only when that
class is first asked for, never by `import kvfsm.compat`.
"""

__all__ = ["sglang", "vllm"]
