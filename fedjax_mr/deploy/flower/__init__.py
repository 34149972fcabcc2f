"""Flower's own programs, each with one change, as the federation starts
them (`python -m fedjax_mr.deploy.flower.<module>` with the arguments of
the Flower program it wraps).

`superlink` (`flower-superlink` whose Control API obeys the operator's
token alone), `supernode` (`flower-supernode` beating at a heartbeat
interval of its own) and `warm` (`flower-superexec` whose App processes
are forks of an interpreter that has imported them). Each leans on names
inside Flower, pinned with Flower's version (pyproject.toml).
"""
