"""Fixtures of the deploy tests."""

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture
def a_run():
  """Flower 1.42 builds a message only inside a run (a ServerApp or
  ClientApp process has its run's and its own node's ids): as one here,
  run 1, node 0, task 1."""
  TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
  yield
  TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None
