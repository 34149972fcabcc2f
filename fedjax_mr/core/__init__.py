"""Interfaces and tree helpers shared by every algorithm."""

from fedjax_mr.core import tree as tree
from fedjax_mr.core import types as types
from fedjax_mr.core.types import Algorithm as Algorithm
from fedjax_mr.core.types import ClientOutput as ClientOutput
from fedjax_mr.core.types import ClientUpdate as ClientUpdate
from fedjax_mr.core.types import Dispatch as Dispatch
from fedjax_mr.core.types import Variables as Variables
