"""Every bad invocation is one line naming the flag or file, exit code 2.

Table-driven: for each program, all its cases run in one subprocess
(`tests.bad_invocations`, flags reset between cases), so the table is fast.
Every case must exit with code 2, print exactly one line on stderr that
contains the given fragment (the flag or file it names), and create
nothing at the program's output path ({S}).
"""

import gzip
import json
import os
import re
import shutil

import numpy as np
import pytest

from fedjax_mr.energy import profiles as energy_profiles
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment
from tests import docs_text
from tests import fork_server
from tests import helpers
from tests.data import test_idx_and_datasets as idx_tests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# program -> [(argv, fragment the one line must contain)]
CASES = {
  'experiments.run': [
    (['--seed=-1'], '--seed'),
    (['--seed=99999999999999999999'], '--seed'),
    (['--alpha=inf'], '--alpha'),
    (['--alpha=0'], '--alpha'),
    (['--alpha=nan'], '--alpha'),
    (['--partition=dirichlet_equal', '--alpha=0'], '--alpha'),
    (['--partition=dirichlet_equal', '--min_client_size=5'], '--min_client'),
    (['--energy_ms_per_sample=nan'], '--energy_ms_per_sample'),
    (['--energy_ms_per_sample=0'], '--energy_ms_per_sample'),
    (
      ['--num_processes=2', '--coordinator_address=nonsense'],
      '--coordinator_address',
    ),
    (
      ['--num_processes=2', '--coordinator_address=h:0'],
      '--coordinator_address',
    ),
    (
      ['--num_processes=2', '--process_id=2', '--coordinator_address=h:1'],
      '--process_id',
    ),
    (['--coordinator_timeout=0'], '--coordinator_timeout must be in'),
    (['--coordinator_timeout=nan'], '--coordinator_timeout must be in'),
    (['--lr=0'], '--lr'),
    (['--lr=nan'], '--lr'),
    (['--lr=inf'], '--lr'),
    (['--momentum=1'], '--momentum'),
    (['--momentum=-0.5'], '--momentum'),
    (['--rounds=0'], '--rounds'),
    (['--num_clients=0'], '--num_clients'),
    (['--clients_per_round=0'], '--clients_per_round'),
    (['--clients_per_round=11'], '--clients_per_round'),
    (['--local_epochs=0'], '--local_epochs'),
    (['--batch_size=0'], '--batch_size'),
    (['--eval_batch_size=0'], '--eval_batch_size'),
    (['--keep_checkpoints=0'], '--keep_checkpoints'),
    (['--eval_every=-1'], '--eval_every'),
    (['--checkpoint_every=-1'], '--checkpoint_every'),
    (['--client_chunk=-1'], '--client_chunk'),
    (['--num_devices=-1'], '--num_devices'),
    (['--host_devices=-1'], '--host_devices'),
    (['--min_client_size=-1'], '--min_client_size'),
    (['--algorithm=bogus'], '--algorithm'),
    (['--model=bogus'], '--model'),
    (['--dataset=bogus'], '--dataset'),
    (['--partition=bogus'], '--partition'),
    (['--partition=natural'], '--partition=natural'),
    (['--leaf_min_samples=5'], '--leaf_min_samples'),
    (['--cifar100_labels=coarse'], '--cifar100_labels'),
    (['--model=char_lstm'], '--model=char_lstm'),
    (['--algorithm=fedprox', '--fedprox_mu=-1'], '--fedprox_mu'),
    (
      ['--algorithm=moon', '--moon_projection_dim=1000000000'],
      '--moon_projection_dim',
    ),
    (
      ['--algorithm=fedgen', '--fedgen_hidden_dim=1000000000'],
      '--fedgen_hidden_dim',
    ),
    (['--num_devices=1000000000'], '--num_devices'),
    # FedMR keeps every client's model: 1,000 VGG-16s (134 MB each) are
    # refused before a round is built, on any machine.
    (
      [
        '--algorithm=fedmr',
        '--model=vgg16',
        '--partition=iid',
        '--num_clients=1000',
        '--clients_per_round=1000',
      ],
      '--clients_per_round=1000',
    ),
    (['--host_devices=1000000'], '--host_devices'),
    (['--batch_size=1000000000'], '--batch_size'),
    (['--algorithm=fedmut', '--fedmut_alpha=nan'], '--fedmut_alpha'),
    (
      ['--algorithm=fedmr', '--fedmr_first_stage=3000000000'],
      '--fedmr_first_stage',
    ),
    (['--algorithm=fedavg', '--fedmut_alpha=2'], '--fedmut_alpha'),
    (['--algorithm=fedexp', '--fedexp_epsilon=-1'], '--fedexp_epsilon'),
    (['--algorithm=fedasam', '--fedasam_rho=nan'], '--fedasam_rho'),
    (['--algorithm=fedsam', '--fedasam_eta=0.5'], '--fedasam_eta'),
    (['--algorithm=clusamp', '--clusamp_distance=l3'], '--clusamp_distance'),
    (['--algorithm=clusamp', '--weighting=examples'], '--weighting'),
    (['--algorithm=moon', '--moon_temperature=0'], '--moon_temperature'),
    (['--algorithm=moon', '--moon_projection_dim=-2'], '--moon_projection_dim'),
    (['--algorithm=fedgen', '--fedgen_decay=0'], '--fedgen_decay'),
    (['--algorithm=fedavg', '--fedgen_noise_dim=8'], '--fedgen_noise_dim'),
    (
      ['--algorithm=scaffold', '--scaffold_control_steps=x'],
      '--scaffold_control_steps',
    ),
    (['--algorithm=scaffold', '--server_lr=0'], '--server_lr'),
    (
      ['--algorithm=scaffold', '--client_optimizer=adam'],
      '--client_optimizer',
    ),
    (['--client_optimizer=rmsprop'], '--client_optimizer'),
    (['--client_optimizer=adam', '--client_beta2=1'], '--client_beta2'),
    (['--client_optimizer=adam', '--momentum=0.5'], '--momentum'),
    (['--client_beta1=0.5'], '--client_beta1'),
    (['--server_optimizer=lamb'], '--server_optimizer'),
    (['--server_optimizer=adam', '--server_epsilon=0'], '--server_epsilon'),
    (['--server_optimizer=yogi', '--server_beta1=1'], '--server_beta1'),
    (
      ['--server_optimizer=momentum', '--server_momentum=0'],
      '--server_momentum',
    ),
    (['--server_optimizer=adam', '--server_momentum=0.5'], '--server_momentum'),
    (['--server_optimizer=adagrad', '--server_beta2=0.9'], '--server_beta2'),
    (['--algorithm=fedmr', '--server_optimizer=adam'], '--server_optimizer'),
    (['--algorithm=indep', '--server_lr=2'], '--server_lr'),
    (
      ['--algorithm=scaffold', '--scaffold_control_dtype=float16'],
      '--scaffold_control_dtype',
    ),
    (['--algorithm=fedmr_p', '--fedmr_segments=0'], '--fedmr_segments'),
    (['--energy_mix=bogus'], '--energy_mix'),
    (['--partition=iid', '--alpha=0.5'], '--alpha'),
    (['--partition=iid', '--min_client_size=5'], '--min_client_size'),
    (['--partition=iid', '--shards_per_client=3'], '--shards_per_client=3'),
    (['--partition=shards', '--shards_per_client=0'], '--shards_per_client'),
    (['--partition=file'], '--partition_file'),
    (['--partition_file=README.md'], '--partition_file=README.md applies'),
    (
      ['--partition=file', '--partition_file=/nonexistent/p.json'],
      '--partition_file=/nonexistent/p.json: cannot read it',
    ),
    (
      ['--partition=file', '--partition_file=README.md'],
      '--partition_file=README.md: not JSON',
    ),
    (
      ['--partition=file', '--partition_file={bad:partition_3_clients}'],
      '3 clients, but --num_clients=10',
    ),
    (
      ['--partition=file', '--partition_file={bad:partition_duplicate}'],
      'partition_duplicate.json: index 7 is in clients 0 and 8',
    ),
    # Checked by type and size before reading (/dev/zero read 3.2 GB; a
    # FIFO waited in open for a writer).
    (
      ['--partition=file', '--partition_file=/dev/zero'],
      '--partition_file=/dev/zero: is not a regular',
    ),
    (
      ['--partition=file', '--partition_file={bad:fifo}'],
      'fifo: is not a regular file (a FIFO)',
    ),
    (
      [
        '--partition=file',
        '--partition_file={bad:partition_duplicate}',
        '--partition_sha256=00',
      ],
      'partition_duplicate.json: its sha256 is',
    ),
    (['--clients_per_round=1', '--num_devices=2'], '--clients_per_round=1'),
    (['--workdir=README.md'], 'README.md'),
    (['--workdir=README.md/sub'], 'README.md/sub'),
    # A name that is not UTF-8 (a command line's byte 0xff, as Python holds
    # it): orbax failed on it after round 1, and on every resume.
    (['--workdir={S}/run\udcff'], 'run\\xff: the name is not valid UTF-8'),
    (['--data_dir=/nonexistent/fmnist'], '/nonexistent/fmnist'),
    # Dir(0.003) gives nearly all of a class to one client: 10 classes
    # cannot give 20 clients 10 examples each (it crashed on NaN shares).
    (
      ['--data_dir={bad:two_hundred}', '--alpha=0.003', '--num_clients=20'],
      'use fewer clients or a larger --alpha',
    ),
    # Damaged IDX files (item 11), each named.
    (['--data_dir={bad:labels_200}'], 'train-labels-idx1-ubyte.gz'),
    (['--data_dir={bad:test_labels_negative}'], 't10k-labels-idx1-ubyte.gz'),
    (['--data_dir={bad:huge_header}'], 'train-images-idx3-ubyte.gz'),
    (['--data_dir={bad:nan_pixels}'], 'train-images-idx3-ubyte.gz'),
    (['--data_dir={bad:test_shape}'], '/b: test images are (27, 28)'),
    # A finished run's workdir (`prepared_runs`; issue 41): every checkpoint
    # with a flipped bit, and the run resumed on relabelled data.
    (
      [
        '--data_dir={bad:tiny_data}',
        '--partition=iid',
        '--workdir={bad:tiny_run_damaged}',
      ],
      'no checkpoint in',
    ),
    (
      [
        '--data_dir={bad:tiny_relabelled}',
        '--partition=iid',
        '--workdir={bad:tiny_run}',
      ],
      '--data_dir=',
    ),
    # Workdirs whose files are not the run's own (issue 55), refused before
    # the data load; /proc, where root may write by os.access, takes no file.
    *[
      (
        [
          '--data_dir={bad:tiny_data}',
          '--partition=iid',
          f'--workdir={{bad:run_{name}}}',
        ],
        fragment,
      )
      for name, fragment in [
        ('lock_link', '.lock is a symbolic link (to '),
        ('lock_folder', '.lock is a folder, where the run keeps a file'),
        ('metrics_link', 'metrics.jsonl is a symbolic link (to '),
        ('checkpoints_link', 'checkpoints is a symbolic link (to '),
        ('checkpoints_file', 'checkpoints is a file, where the run keeps'),
      ]
    ],
    (['--workdir=/proc/fedjax_mr'], '/proc does not take new files'),
    (['--rounds=abc'], '--rounds'),
    (['--bogus_flag=1'], 'bogus_flag'),
    (['--flagfile=/nonexistent/x.flags'], '/nonexistent/x.flags'),
    # Flagfiles checked by type and size (os.stat) before reading: a 70 MB
    # one hung past 290 s, a 2 MB one was echoed whole; a folder or a
    # device was "no such file".
    (
      ['--flagfile={bad:flagfile_70mb}'],
      'flagfile_70mb.flags: holds 73,400,320 bytes, more than the 1,048,576',
    ),
    (
      ['--flagfile={bad:flagfile_2mb}'],
      'flagfile_2mb.flags: holds 2,097,152 bytes, more than the 1,048,576',
    ),
    (
      ['--flagfile={bad:flagfile_twice}'],
      'holds 600,000 bytes, more than the 448,514 allowed (the flagfiles',
    ),
    (['--flagfile={bad:folder}'], 'folder: is a folder'),
    (
      ['--flagfile=/dev/zero'],
      '--flagfile=/dev/zero: is not a regular file (a character device)',
    ),
    (['--flagfile={bad:fifo}'], 'fifo: is not a regular file (a FIFO)'),
    (['--flagfile={bad:flagfile_latin1}'], 'not UTF-8 text (byte 0xe9'),
    # What the user gave is quoted clipped, its control characters escaped.
    (['x' * 5000], 'unexpected arguments: xxx'),
    (['--rounds=\x1b[2J' + '9' * 5000], '--rounds'),
    (
      ['--partition=file', '--partition_file={bad:folder}'],
      'folder: is a folder (a partition file is',
    ),
    (['positional'], 'unexpected arguments'),
  ],
  'experiments.compare': [
    (['--seeds=0,0'], '--seeds: seed 0 appears twice'),
    (['--seeds=-1'], '--seeds'),
    (['--seeds=a'], '--seeds'),
    (['--seeds=99999999999'], '--seeds'),
    (['--variants=bogus'], '--variants'),
    (['--variants=fedavg,fedavg'], '--variants'),
    (['--last=0'], '--last'),
    (['--variants=', '--variant=x:nofield=1'], 'nofield'),
    (['--variants=', '--variant=x:lr=abc'], 'lr'),
    (['--variants=', '--variant=..:lr=0.1'], '--variants'),
    (['--variants=', '--variant=a/b:lr=0.1'], '--variants'),
    (['--variants=', '--variant=x:seed=5'], '--seeds'),
    (['--variants=', '--variant=x:workdir=/tmp/elsewhere'], '--workdir'),
    # A folder named as the table would stop its write, after training.
    (
      ['--variants=', '--variant=results.md:lr=0.1'],
      "--variants: variant name 'results.md'",
    ),
    # Dir(1e-300) underflows to no mass at all (it crashed on NaN shares).
    (
      [
        '--variants=fedavg',
        '--data_dir={bad:two_hundred}',
        '--alpha=1e-300',
        '--num_clients=20',
      ],
      'use fewer clients or a larger --alpha',
    ),
    (['--variants=fedavg', '--lr=-1'], '--lr'),
    (['--variants=fedavg', '--rounds=0'], '--rounds'),
    (['--data_dir={bad:test_shape}'], '/b: test images are (27, 28)'),
    (['--workdir=README.md'], '--workdir=README.md'),
    (['--out=README.md/sub'], '--workdir=README.md/sub'),  # earlier name
    (['--workdir={S}/run\udcff'], 'run\\xff: the name is not valid UTF-8'),
    (['positional'], 'unexpected arguments'),
  ],
  'experiments.benchmark': [
    (['--rounds=0'], '--rounds'),
    (['--batch_size=0'], '--batch_size'),
    (['--local_epochs=0'], '--local_epochs'),
    (['--num_clients=5'], '--clients_per_round'),
    (['--clients_per_round=0'], '--clients_per_round'),
    (['--alpha=inf'], '--alpha'),
    (['--num_devices=-1'], '--num_devices'),
    (['--num_devices=x'], '--num_devices'),
    (['--num_devices=7'], '--num_devices=7'),
    (['--threads=-1'], '--threads'),
    (['--threads=1000000'], '--threads must be at most'),
    (
      [
        '--data_dir={bad:two_hundred}',
        '--sizes=dirichlet',
        '--alpha=0.003',
        '--num_clients=20',
      ],
      'use fewer clients or a larger --alpha',
    ),
    (['--eval_every=0'], '--eval_every'),
    (['--eval_batch_size=0'], '--eval_batch_size'),
    (['--rounds=abc'], '--rounds'),
    (['--algorithm=nope'], '--algorithm'),
    (['--fedprox_mu=0.5'], '--fedprox_mu'),
    (['--algorithm=fedgen', '--fedgen_noise_dim=0'], '--fedgen_noise_dim'),
    (['--dataset=synthetic'], '--model=cnn_mnist'),
    (['--dataset=synthetic', '--model=logistic', '--sizes=equal'], '--sizes'),
    (['--dataset=synthetic', '--model=logistic', '--alpha=0.5'], '--alpha'),
    (
      ['--dataset=synthetic', '--model=logistic', '--synthetic_beta=-1'],
      '--synthetic_beta',
    ),
    (['--synthetic_alpha=0.5'], '--synthetic_alpha=0.5'),
    (['--sizes=range', '--max_client_size=5'], '--min_client_size'),
    (['--limit_batch=-1'], '--limit_batch'),
    (['--client_chunks=1,x'], '--client_chunks'),
    (['--compute_dtype=float16'], '--compute_dtype'),
    (
      ['--dataset=synthetic', '--model=logistic', '--random_data'],
      '--random_data',
    ),
    (['positional'], 'unexpected arguments'),
  ],
  'experiments.pretrain_zoo': [
    (['--batch_size=0'], '--batch_size'),
    (['--epochs=0'], '--epochs'),
    (['--public_size=0'], '--public_size'),
    (['--lr=nan'], '--lr'),
    (['--learning_rate=nan'], '--lr'),  # its earlier name
    (['--seed=-1'], '--seed'),
    (['--models=bogus'], '--models'),
    # A model that cannot take the dataset's examples: refused before the
    # workdir is made.
    (['--models=char_lstm'], '--models: char_lstm takes token sequences'),
    (['--dataset=bogus'], '--dataset'),
    (['--workdir=README.md'], '--workdir=README.md'),
    (['--workdir=README.md/sub'], 'README.md/sub'),
    (['--workdir={S}/run\udcff'], 'run\\xff: the name is not valid UTF-8'),
    (['--data_dir={bad:labels_200}'], 'train-labels-idx1-ubyte.gz'),
    (['positional'], 'unexpected arguments'),
  ],
  'experiments.stitch': [
    (['--eval=bogus'], '--eval'),
    (['--aggregation=vote'], '--aggregation'),
    (['--energy_mix=nosuch@1:1'], '--energy_mix'),
    (['--cuts=some'], '--cuts'),
    (['--clients_per_round=50', '--num_clients=20'], '--clients_per_round'),
    (['--eval_examples=-5'], '--eval_examples'),
    (['--alpha=0'], '--alpha'),
    (['--dirichlet_alpha=nan'], '--alpha'),  # its earlier name
    (['--partition=iid', '--alpha=0.5'], '--alpha'),
    (['--seed=-1'], '--seed'),
    (['--epsilon=nan'], '--epsilon'),
    (['--reward=inf'], '--reward'),
    (['--threshold=2'], '--threshold'),
    (['--knn_reference=0'], '--knn_reference'),
    (['--local_clients=200'], '--local_clients'),
    (['--batch_size=1'], '--batch_size'),
    (['--max_depth=1'], '--max_depth'),
    (['--stitch_solver=lu'], '--stitch_solver'),
    (['--label_map=/nonexistent/map.json'], '/nonexistent/map.json'),
    (['--label_map=README.md'], '--label_map=README.md'),
    (['--label_map=/dev/zero'], '--label_map=/dev/zero: is not a regular file'),
    (['--label_map={bad:folder}'], 'folder: is a folder'),
    (['--label_map={bad:deep_json}'], 'not JSON (nested too deeply)'),
    # A pool whose meta.json is not JSON, not an object, or holds a field
    # of the wrong type (tracebacks of 42-54 lines, exit 1).
    (
      ['--pool={bad:pool_not_json}', '--data_dir={bad:two_hundred}'],
      'm/meta.json: not JSON (Expecting value',
    ),
    (
      ['--pool={bad:pool_list}', '--data_dir={bad:two_hundred}'],
      'm/meta.json: holds a list, not an object',
    ),
    (
      ['--pool={bad:pool_classes_abc}', '--data_dir={bad:two_hundred}'],
      'm/meta.json: "num_classes" is the string "abc", not an integer',
    ),
    (
      ['--pool={bad:pool_meta_folder}', '--data_dir={bad:two_hundred}'],
      'm/meta.json: is a folder',
    ),
    (
      ['--pool={bad:pool_no_variables}', '--data_dir={bad:two_hundred}'],
      'm/variables: no such folder',
    ),
    (
      [
        '--energy_backend=dry_run',
        '--energy_sysfs_root=experiments',
        '--energy_profile={bad:profile_nan}',
      ],
      'profile_nan.json: "p_idle_w" is nan, not finite',
    ),
    (
      [
        '--energy_backend=dry_run',
        '--energy_sysfs_root=experiments',
        '--energy_profile={bad:folder}',
      ],
      'folder: is a folder',
    ),
    (['--num_clients=100000000'], '--num_clients must be at most 1,048,576'),
    (['--batch_size=1000000000'], '--batch_size must be at most 4,096'),
    # The bundled CIFAR-10 map by name: its ImageNet ids exceed the test
    # pool's 10-class heads; with --classes, the entries of those classes.
    (
      ['--imagenet_pool=tests/stitch/data/torchvision', '--label_map=cifar10'],
      'got [404, 895, 908]',
    ),
    (
      [
        '--imagenet_pool=tests/stitch/data/torchvision',
        '--label_map=cifar10',
        '--classes=6-7',
      ],
      'got [30, 31, 32]',
    ),
    (['--workdir=README.md'], 'README.md'),
    (['--workdir=README.md/sub'], 'README.md/sub'),
    (['--workdir={S}/run\udcff'], 'run\\xff: the name is not valid UTF-8'),
    (['--energy_mix=bogus'], '--energy_mix'),
    (['--energy_backend=bogus'], '--energy_backend'),
    (['--energy_ms_per_score=0'], '--energy_ms_per_score'),
    (['--energy_ms_per_score=nan'], '--energy_ms_per_score'),
    (['--energy_profile=tx2_chained'], '--energy_profile'),
    (['--energy_backend=sysfs'], '--energy_profile'),
    (
      [
        '--energy_backend=dry_run',
        '--energy_profile=tx2_chained',
        '--energy_mix=tx2_literal:1',
      ],
      '--energy_mix',
    ),
    (
      ['--energy_backend=dry_run', '--energy_profile=nosuch'],
      '--energy_profile=nosuch',
    ),
    (
      [
        '--energy_backend=sysfs',
        '--energy_profile=tx2_chained',
        '--energy_sysfs_root=/nonexistent/sys',
      ],
      '--energy_sysfs_root=/nonexistent/sys',
    ),
    (
      [
        '--energy_backend=sysfs',
        '--energy_profile=tx2_chained',
        '--energy_sysfs_root=experiments',
      ],
      '--energy_sysfs_root=experiments with --energy_profile=tx2_chained: no',
    ),
    (['--pool=/nonexistent/pool'], '/nonexistent/pool'),
    (['--dataset=bogus'], '--dataset'),
    (['--num_clients=x'], '--num_clients'),
    (['positional'], 'unexpected arguments'),
  ],
  'experiments.zoo_report': [
    (['--models=bogus'], '--models'),
    (['--repeats=0'], '--repeats'),
    (['positional'], 'unexpected arguments'),
  ],
  'experiments.landscape': [
    (['--steps=4'], '--steps'),
    (['--steps=1'], '--steps'),
    (['--extent=0'], '--extent'),
    (['--extent=nan'], '--extent'),
    (['--steps=100001'], '--steps'),
    (['--extent=1e308'], '--extent'),
    (['--num_examples=-1'], '--num_examples'),
    (['--split=valid'], '--split'),
    (['--seed=-1'], '--seed'),
    (['--points_per_pass=0'], '--points_per_pass'),
    (['--round=-1'], '--round'),
    ([], '/nonexistent/run'),
    (['--workdir='], '--workdir'),
    (['--workdir=README.md'], 'README.md'),
    (['--workdir=experiments'], 'experiments/config.json'),
    (['--workdir=experiments', '--output=README.md'], '--output=README.md'),
    (['positional'], 'unexpected arguments'),
  ],
  'experiments.deploy': [
    (['--nodes=0'], '--nodes'),
    (['--nodes=-2'], '--nodes'),
    (['--nodes=x'], '--nodes'),
    (['--round_timeout=-1'], '--round_timeout'),
    (['--round_timeout=nan'], '--round_timeout'),
    (['--round_timeout=inf'], '--round_timeout'),
    (['--node_heartbeat_s=5'], '--node_heartbeat_s=5.0'),
    (['--node_heartbeat_s=nan'], '--node_heartbeat_s'),
    (
      [
        '--superlink=127.0.0.1:9',
        '--insecure_federation',
        '--node_heartbeat_s=10',
      ],
      '--node_heartbeat_s',
    ),
    (['--seed=-1'], '--seed'),
    (
      ['--algorithm=fedmr', '--fedmr_secure_repeats=1'],
      '--fedmr_secure_repeats',
    ),
    (['--superlink=nohost'], '--superlink=nohost: address'),
    (['--superlink=127.0.0.1:9'], '--insecure_federation'),
    (
      ['--superlink=127.0.0.1:9', '--root_certificates=/nonexistent/ca.crt'],
      '--root_certificates=/nonexistent/ca.crt: no such file',
    ),
    (['--root_certificates=ca.crt'], '--superlink'),
    (
      ['--superlink=127.0.0.1:9', '--insecure_federation', '--node_ids=1,2,3'],
      '--node_ids',
    ),
    (['--superlink=127.0.0.1:9', '--node_ids=a,b'], '--node_ids=a,b'),
    # Issue 71: a SuperLink reached from other machines only on purpose; a
    # secure --superlink run only with the operator's token and node ids.
    (['--federation_host=0.0.0.0'], '--expose_federation'),
    (['--federation_host=10.1.2.3'], '--expose_federation'),
    (
      ['--superlink=127.0.0.1:9', '--root_certificates=README.md'],
      '--operator_token',
    ),
    (
      [
        '--superlink=127.0.0.1:9',
        '--root_certificates=README.md',
        '--operator_token=/nonexistent/token',
      ],
      '--operator_token=/nonexistent/token',
    ),
    (
      [
        '--superlink=127.0.0.1:9',
        '--root_certificates=README.md',
        '--operator_token=LICENSE',
      ],
      'not an operator token',
    ),
    (['--operator_token=token'], '--superlink'),
    (
      [
        '--superlink=127.0.0.1:9',
        '--insecure_federation',
        '--operator_token=LICENSE',
      ],
      '--operator_token would cross the network in the clear',
    ),
  ],
  'experiments.deploy_stitch': [
    (['--nodes=0'], '--nodes'),
    (['--round_timeout=-1'], '--round_timeout'),
    (['--node_heartbeat_s=3600'], '--node_heartbeat_s=3600.0'),
    (['--num_clients=0'], '--num_clients'),
    (['--pool=/nonexistent/pool'], '--pool'),
    (['--energy_backend=sysfs'], '--energy_profile'),
    (['--federation_host=0.0.0.0'], '--expose_federation'),
    (['positional'], 'unexpected arguments'),
  ],
  'experiments.probe': [
    ([], '--workdir='),
    (['--workdir='], '--workdir'),
    (['--workdir=README.md'], '--workdir=README.md: not a folder'),
    (['--workdir=experiments'], 'experiments/config.json'),
    (['--knn_reference=0'], '--knn_reference'),
    (['--knn_reference=x'], '--knn_reference'),
    # A finished run that did not start from a pool model (`prepared_runs`).
    (['--workdir={bad:tiny_run}'], '--pool is needed'),
    (
      ['--workdir={bad:tiny_run}', '--pool=/nonexistent/pool'],
      '--pool=/nonexistent/pool: no public.json',
    ),
    (['positional'], 'unexpected arguments'),
  ],
  'experiments.profile_device': [
    (['--sysfs_root=/nonexistent/sys'], '--sysfs_root'),
    (['positional'], 'unexpected arguments'),
  ],
  'experiments.prepare': [
    (['--datasets=bogus'], '--datasets'),
    (['--datasets='], '--datasets'),
    (['--datasets=femnist,femnist'], '--datasets'),
    (['--leaf_train_fraction=1'], '--leaf_train_fraction'),
    (['--leaf_train_fraction=0'], '--leaf_train_fraction'),
    (['--leaf_train_fraction=nan'], '--leaf_train_fraction'),
    (['--leaf_train_fraction=x'], '--leaf_train_fraction'),
    (['--leaf_seed=-1'], '--leaf_seed'),
    (['--keep_downloads=maybe'], '--keep_downloads'),
    (['--data_dir=README.md'], '--data_dir=README.md'),
    (['positional'], 'unexpected arguments'),
  ],
}
# Where each program writes (every case points it at the scratch folder
# {S}), and a small setting, so that a case wrongly accepted fails fast.
_SMALL = '--num_clients=10 --clients_per_round=2 --rounds=1 --local_epochs=1'
BASE = {
  'experiments.run': ['--workdir={S}', *_SMALL.split()],
  'experiments.compare': ['--workdir={S}', '--seeds=0', *_SMALL.split()],
  'experiments.pretrain_zoo': ['--workdir={S}', '--epochs=1'],
  'experiments.stitch': ['--workdir={S}'],
  'experiments.landscape': ['--workdir=/nonexistent/run', '--output={S}'],
  # Writes into --workdir: {S}, which no case may create.
  'experiments.probe': ['--workdir={S}'],
  # Writes into --workdir: {S}, which no case may create.
  'experiments.deploy': ['--workdir={S}', '--rounds=1'],
  'experiments.deploy_stitch': ['--workdir={S}'],
  'experiments.profile_device': ['--output={S}/profile.json'],
  'experiments.benchmark': ['--rounds=1', '--local_epochs=1'],
  # cinic10: a case wrongly accepted fails fast (no network, or a download
  # into the scratch folder).
  'experiments.prepare': ['--data_dir={S}', '--datasets=cinic10'],
}
_LOG_LINE = re.compile(r'^[IWEF]\d{4} ')  # absl log lines (not errors)
MAX_LINE = 2100  # an error line: its message, user content clipped
_CONTROL = re.compile(r'[\x00-\x08\x0b-\x1f\x7f]')


def test_the_table_has_at_least_80_cases_and_the_docs_count_them():
  n = sum(len(c) for c in CASES.values())
  assert n >= 80
  text = ' '.join(docs_text.all_text().split())  # on whichever page
  words = {9: 'nine', 10: 'ten', 11: 'eleven', 12: 'twelve'}
  said = f'({n} invocations of {words.get(len(CASES), len(CASES))} programs)'
  assert said in text, said


@pytest.fixture(scope='module')
def bad_data(tmp_path_factory):
  """{name: a Fashion-MNIST IDX folder with one damaged file}."""
  root = tmp_path_factory.mktemp('bad_idx')
  out = {
    'labels_200': idx_tests.idx_folder(root / 'a', y_train=np.full(20, 200)),
    'test_shape': idx_tests.idx_folder(
      root / 'b', x_test=np.zeros((5, 27, 28))
    ),
  }
  out['test_labels_negative'] = idx_tests.idx_folder(root / 'c')
  idx_tests.write_typed(
    os.path.join(out['test_labels_negative'], 't10k-labels-idx1-ubyte.gz'),
    np.full(5, -1, np.int8),
    0x09,
  )
  out['nan_pixels'] = idx_tests.idx_folder(root / 'd')
  idx_tests.write_typed(
    os.path.join(out['nan_pixels'], 'train-images-idx3-ubyte.gz'),
    np.full((20, 28, 28), np.nan, '>f4'),
    0x0D,
  )
  out['huge_header'] = idx_tests.idx_folder(root / 'e')
  header = bytes([0, 0, 8, 3]) + b''.join(
    d.to_bytes(4, 'big') for d in (2**32 - 1, 28, 28)
  )
  path = os.path.join(out['huge_header'], 'train-images-idx3-ubyte.gz')
  with gzip.open(path, 'wb') as f:
    f.write(header + bytes(100))
  # Partition files (--partition_file) for 10 clients, each wrong.
  for name, clients in [
    ('partition_3_clients', [[0], [1], [2]]),
    ('partition_duplicate', [[7]] + [[i] for i in range(9)]),
  ]:
    out[name] = str(root / f'{name}.json')
    with open(out[name], 'w') as f:
      json.dump(clients, f)
  out['fifo'] = str(root / 'fifo')
  # 20 examples of each class (the tiny-alpha Dirichlet cases).
  out['two_hundred'] = idx_tests.idx_folder(
    root / 'f',
    x_train=np.zeros((200, 28, 28)),
    y_train=np.repeat(np.arange(10), 20),
  )
  os.mkfifo(out['fifo'])
  _bad_inputs(root, out)
  return out


def _bad_inputs(root, out) -> None:
  """Adds to `out` the flagfiles, pools and JSON files of the input
  cases: each the smallest that shows the fault."""
  out['folder'] = str(root / 'folder')
  os.makedirs(out['folder'])
  flagfiles = {
    'flagfile_2mb': b'x' * (2 << 20),
    'flagfile_half': b'# ' + b'x' * 599_997 + b'\n',
    'flagfile_twice': b'--flagfile=flagfile_half.flags\n' * 2,
    'flagfile_latin1': '--dataset=caf\xe9\n'.encode('latin-1'),
  }
  for name, data in flagfiles.items():
    out[name] = str(root / f'{name}.flags')
    with open(out[name], 'wb') as f:
      f.write(data)
  out['flagfile_70mb'] = str(root / 'flagfile_70mb.flags')
  with open(out['flagfile_70mb'], 'wb') as f:
    f.truncate(70 << 20)  # sparse: its size is all that is looked at
  out['deep_json'] = str(root / 'deep.json')
  with open(out['deep_json'], 'w') as f:
    f.write('[' * 100_000)
  meta = {'model': 'cnn_mnist', 'num_classes': 10, 'input_shape': [28, 28, 1]}
  pools = {
    'pool_not_json': '{"model": ',
    'pool_list': '[1, 2]',
    'pool_classes_abc': json.dumps({**meta, 'num_classes': 'abc'}),
    'pool_no_variables': json.dumps(meta),
    'pool_meta_folder': None,
  }
  for name, text in pools.items():
    out[name] = str(root / name)
    meta_path = os.path.join(out[name], 'm', 'meta.json')
    if text is None:
      os.makedirs(meta_path)
      continue
    os.makedirs(os.path.dirname(meta_path))
    with open(meta_path, 'w') as f:
      f.write(text)
  profile = energy_profiles.TX2_TABLE2_CHAINED.to_dict()
  out['profile_nan'] = str(root / 'profile_nan.json')
  with open(out['profile_nan'], 'w') as f:
    json.dump({**profile, 'p_idle_w': float('nan')}, f)


@pytest.fixture(scope='module')
def prepared_runs(tmp_path_factory):
  """{name: a folder}: a finished 1-round run of `experiments.run`'s
  `BASE` flags with `--partition=iid` on a 20-example IDX folder
  (`tiny_data`, `tiny_run`), a copy of it whose every checkpoint has a
  flipped bit (`tiny_run_damaged`), and the data relabelled
  (`tiny_relabelled`)."""
  root = tmp_path_factory.mktemp('prepared_runs')
  out = {
    'tiny_data': idx_tests.idx_folder(root / 'data'),
    'tiny_relabelled': idx_tests.idx_folder(
      root / 'relabelled', y_train=(np.arange(20) + 1) % 10
    ),
    'tiny_run': str(root / 'run'),
    'tiny_run_damaged': str(root / 'damaged'),
  }
  config = config_lib.ExperimentConfig.from_flat(
    data_dir=out['tiny_data'],
    partition='iid',
    num_clients=10,
    clients_per_round=2,
    rounds=1,
    local_epochs=1,
  )
  experiment.train_and_evaluate(config, out['tiny_run'], log=lambda _: None)
  shutil.copytree(out['tiny_run'], out['tiny_run_damaged'])
  folder = os.path.join(out['tiny_run_damaged'], 'checkpoints')
  for step in os.listdir(folder):
    helpers.flip_checkpoint_byte(os.path.join(folder, step))
  _not_its_own(root, out)
  return out


def _not_its_own(root, out):
  """Adds copies of `out['tiny_run']` whose files are not their own:
  `run_lock_link`, `run_lock_folder`, `run_metrics_link`,
  `run_checkpoints_link` (links to `root/outside`) and
  `run_checkpoints_file`."""
  outside = root / 'outside'
  outside.mkdir()
  (outside / 'x').write_text('precious')
  for name, entry in [
    ('lock_link', '.lock'),
    ('lock_folder', '.lock'),
    ('metrics_link', 'metrics.jsonl'),
    ('checkpoints_link', 'checkpoints'),
    ('checkpoints_file', 'checkpoints'),
  ]:
    work = out[f'run_{name}'] = str(root / name)
    shutil.copytree(out['tiny_run'], work)
    path = os.path.join(work, entry)
    if os.path.isdir(path):
      shutil.rmtree(path)
    else:
      os.remove(path)
    if name.endswith('_link'):
      os.symlink(outside / ('x' if entry != 'checkpoints' else ''), path)
    elif name == 'lock_folder':
      os.mkdir(path)
    else:
      with open(path, 'w') as f:
        f.write('not a folder')


def _substitute(arg, scratch, bad_data):
  arg = arg.replace('{S}', scratch)
  return re.sub(r'\{bad:(\w+)\}', lambda m: bad_data[m.group(1)], arg)


@pytest.mark.parametrize('program', sorted(CASES))
def test_bad_invocations(program, tmp_path, bad_data, request):
  scratch = str(tmp_path / 'out')
  if program in ('experiments.run', 'experiments.probe'):
    bad_data = {**bad_data, **request.getfixturevalue('prepared_runs')}
  extra = BASE.get(program, [])
  argvs = [
    [_substitute(a, scratch, bad_data) for a in [*extra, *argv]]
    for argv, _ in CASES[program]
  ]
  # A process of its own, forked from one that imported the libraries the
  # programs share (tests/fork_server.py): each program's own
  # imports and flags are made in it, as `python -m` makes them.
  proc = fork_server.run_module(
    'tests.bad_invocations',
    program,
    json.dumps(argvs),
    scratch,
    cwd=REPO,
    env=dict(os.environ),
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(proc.stdout.strip().splitlines()[-1])
  problems = []
  for (argv, fragment), r in zip(CASES[program], results, strict=True):
    lines = [
      x
      for x in r['stderr'].splitlines()
      if x.strip() and not _LOG_LINE.match(x)
    ]
    ok = (
      r['code'] == 2
      and len(lines) == 1
      and lines[0].startswith('error: ')
      and fragment in lines[0]
      and not r['wrote']
      # A line, not what the user gave whole; no terminal escapes.
      and len(lines[0]) <= MAX_LINE
      and not _CONTROL.search(lines[0])
    )
    if not ok:
      problems.append(
        f'{" ".join(argv)}: exit {r["code"]}, wrote {r["wrote"]}, '
        f'stderr {r["stderr"][-600:]!r}'
      )
  assert not problems, '\n'.join(problems)
