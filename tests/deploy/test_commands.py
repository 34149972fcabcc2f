"""Flower's command lines and what the federation reads of their output
(fedjax_mr/deploy/flower/commands.py)."""

from fedjax_mr.deploy.flower import commands


def test_options_and_config_pairs_as_flower_reads_them():
  assert commands.options(
    superlink='h:1', max_retries=0, insecure=True, port=None
  ) == ['--superlink', 'h:1', '--max-retries', '0', '--insecure']
  assert (
    commands.config_pairs(
      {'node-index': 2, 'on': True, 'state': '/a "b"\\c', 'x': 0.5}
    )
    == 'node-index=2 on=true state="/a \\"b\\"\\\\c" x=0.5'
  )


def test_only_the_apps_own_lines_reach_the_terminal():
  own = ['round 1/2 | train loss 1.4998', 'federation: up', 'done: 2 rounds']
  flower = [
    'DEBUG:flwr:[flwr-serverapp] Pull task input',
    'INFO:flwr:Start `flwr-serverapp` process',
    'WARNING:flwr:Connection attempt failed',
    '\x1b[92mINFO \x1b[0m:      Starting Flower SuperExec',
    'Successfully started run 123',
    'Using SuperLink: local (127.0.0.1:1)',
    '   ',
  ]
  assert all(commands.own_line(line + '\n') for line in own)
  assert not any(commands.own_line(line + '\n') for line in flower)
  found = commands.STARTED.search('🎊 Successfully started run 4242\n')
  assert found and found.group(1) == '4242'


def test_a_result_the_server_could_not_write_comes_through_the_stream():
  result = {'error': 'cannot write /w/metrics.jsonl: No space left'}
  line = commands.result_line(result) + '\n'
  assert commands.read_result(line) == result
  assert not commands.own_line(line)  # the launcher says it, once
  for other in ('round 1/2', commands.RESULT_MARK + '[1]', 'x' + line):
    assert commands.read_result(other) is None


class _FullDisk:
  name = '/full/run.log'

  def __init__(self):
    self.closed = False

  def write(self, line):
    raise OSError(28, 'No space left on device')

  def flush(self):
    pass

  def close(self):
    self.closed = True
    raise OSError(28, 'No space left on device')


def test_a_run_log_that_cannot_be_written_is_said_once(tmp_path):
  said = []
  out = _FullDisk()
  log = commands.RunLog(out, said.append)
  for line in ('a\n', 'b\n', 'c\n'):
    log.keep(line)
    log.echo(line.strip())
  assert said[0] == (
    'warning: cannot write /full/run.log: No space left on device; the '
    "rest of this run's Flower log is not kept"
  )
  assert said[1:] == ['a', 'b', 'c'] and out.closed
  path = tmp_path / 'run.log'
  with open(path, 'a') as f:
    kept = commands.RunLog(f, None)
    kept.keep('x\n')
    kept.echo('nowhere')
  assert path.read_text() == 'x\n'
