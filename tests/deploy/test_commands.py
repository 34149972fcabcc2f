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
