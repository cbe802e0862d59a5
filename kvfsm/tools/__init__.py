"""The tools: kvfsm's command line and what only it uses.

Nothing in the library imports from here. The core (`kvfsm`), the
adapters (`kvfsm.backends`) and the compat layers (`kvfsm.compat`) are the
library; this package is what runs on top of them:

* `cli`: the `kvfsm` command, one subcommand per module, imported on demand;
* `simulate` and `simulate_remote`: `kvfsm simulate`, in one process or as
  prefill and decode processes over Mooncake or NIXL (`_simulation` holds
  their shared summary and verification);
* `bench` (the harness) and `_baselines` (what it measures against):
  `kvfsm bench`;
* `diagrams`: `kvfsm diagram`, drawn from the lifecycle machine and the wire
  tables, with the drift check the docs' diagrams are held to;
* `_cliargs` (argument types and the commands' errors) and `_native_log`
  (the engines' native log lines routed into Python logging).
"""
