"""The algorithms the experiment programs know, one entry each.

An entry names the algorithm's hyper-parameter dataclass (each field is a
config field `<prefix>_<field>`, or the name its `Flag` gives, and a flag
of the programs), the flags' help text and allowed values (`flags`), its
factory `factory(setting, hparams) -> Algorithm`, its default aggregation
weights ('examples' or 'uniform', what `weighting=auto` means for it),
whether it keeps K different models (their accuracies are then evaluated
too), named variants for `experiments.compare`, optionally how it changes
the network the clients train (MOON's projection head), its name in
figures and tables (`display_name`) and whether it takes a server
optimizer. The flags of `experiments.run`, their help, the list of
`algorithm` choices and compare's variants are generated from here: an
algorithm's module holds its maths and its hyper-parameters (their fields,
defaults and checks), this one the words the programs show for them.
Adding an algorithm is one module and one entry below.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable
from typing import Mapping
from typing import NamedTuple

import optax

from fedjax_mr.algorithms import clusamp
from fedjax_mr.algorithms import depthfl
from fedjax_mr.algorithms import fedasam
from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedepth
from fedjax_mr.algorithms import fedexp
from fedjax_mr.algorithms import fedgen
from fedjax_mr.algorithms import fedmr
from fedjax_mr.algorithms import fedmut
from fedjax_mr.algorithms import fedprox
from fedjax_mr.algorithms import finetune
from fedjax_mr.algorithms import heterofl
from fedjax_mr.algorithms import moon
from fedjax_mr.algorithms import scaffold
from fedjax_mr.core import grouping
from fedjax_mr.core import types
from fedjax_mr.models import model as model_lib
from fedjax_mr.models import multi_exit
from fedjax_mr.training import client


class Setting(NamedTuple):
  """What a factory builds an algorithm for (beside its hyper-parameters).

  Attributes:
    local: how clients train.
    clients_per_round: K.
    num_clients: N.
    weighted: aggregate by numbers of examples (else the plain mean).
    variables: the initial model as `model.init` returns it (its key order
      is the model's layer order).
    server_optimizer: the server's step on the pseudo-gradient, for the
      entries with `server_optimizer=True`; None: SGD at rate 1 (the
      plain aggregate).
  """

  local: client.LocalTraining
  clients_per_round: int
  num_clients: int
  weighted: bool
  variables: types.Variables
  server_optimizer: optax.GradientTransformation | None = None


class Flag(NamedTuple):
  """The flag of one hyper-parameter (a field of an entry's `hparams`).

  Attributes:
    help: its help text.
    choices: the values it allows (listed in the help; checked where a
      config is checked); None: any value of its type.
    name: the flag, where it is not `<prefix>_<field>`.
  """

  help: str
  choices: tuple[str, ...] | None = None
  name: str = ''


class HparamFlag(NamedTuple):
  """A hyper-parameter under its flag (what `flags_of` gives).

  Attributes:
    field: the field of the entry's `hparams` dataclass.
    help: the flag's help text.
    choices: the values it allows (None: any).
  """

  field: dataclasses.Field
  help: str
  choices: tuple[str, ...] | None

  @property
  def default(self) -> Any:
    return self.field.default

  @property
  def type(self) -> Any:
    return self.field.type


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
  """One algorithm of the registry (see the module docstring).

  Attributes:
    hparams: the hyper-parameter dataclass (its fields are the flags).
    flags: `{field: Flag}`, the help text (and allowed values, and the
      name where it is not `<prefix>_<field>`) of each field's flag.
    factory: `factory(setting, hparams) -> Algorithm`, of hparams that
      `hparams.validate(**setting)` passed (the config's checks run it,
      once); it checks what it alone can (against the model).
    label: the name in figures and tables ('FedMR').
    weighting: 'examples' or 'uniform', what weighting 'auto' means.
    multi_model: keeps K different models (their accuracies are evaluated).
    prefix: the flags' prefix ('' means the registry name).
    variants: compare's named variants, `{name: {flag: value}}`.
    variant_labels: a variant's name in figures, where it has one of its
      own ('FedAdam'); the others are named by the fields they change.
    model: `model(zoo model, hparams) -> the network the algorithm trains`;
      None: the zoo model unchanged.
    server_optimizer: the factory takes `Setting.server_optimizer` (its
      server steps toward an aggregate of the clients' models).
  """

  hparams: type
  factory: Callable[[Setting, Any], types.Algorithm]
  flags: Mapping[str, Flag] = dataclasses.field(default_factory=dict)
  label: str
  weighting: str = 'examples'
  multi_model: bool = False
  prefix: str = ''
  variants: Mapping[str, Mapping[str, Any]] = dataclasses.field(
    default_factory=dict
  )
  variant_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
  model: Callable[[model_lib.Model, Any], model_lib.Model] | None = None
  server_optimizer: bool = False


# The flags of hyper-parameters that several entries share.
_GROUPING = Flag(
  'What one layer is: leaf (every tensor, params and BatchNorm '
  "statistics, as the authors' code) or module (kernel and bias of one "
  'module together).',
  choices=grouping.GROUPINGS,
)
_FEDMR_FLAGS = {
  'first_stage': Flag(
    'Rounds of the first (FedAvg) stage of two-stage training; '
    'recombination starts after them (papers: 0 for the CNN, 100 for '
    'ResNet-20 and VGG-16).'
  ),
  'grouping': _GROUPING,
  'secure_repeats': Flag(
    'Repeats r_s of the client-to-client secure recombination before '
    'upload (0: none).'
  ),
  'secure_min_sent': Flag(
    'Secure recombination: least number of layers a client sends per '
    'repeat (n_l).'
  ),
  'secure_max_sent': Flag(
    'Secure recombination: most layers a client sends per repeat (n_u); '
    '0: all layers.'
  ),
}
# The memory-constrained baselines' (`budgets.BudgetHparams`).
_BUDGET_FLAGS = {
  'budgets_gb': Flag(
    'Comma-separated client memory budgets in GB '
    "(FedStitch's comparison: 1, 2, 4, 8)."
  ),
  'budget_fractions': Flag(
    'Share of the clients with each budget (FedStitch: 0.3, 0.3, 0.3, 0.1).'
  ),
  'budget_seed': Flag('Seed of which clients get which budget.'),
  'reference_size': Flag(
    'Image side at which training memory is measured '
    "(224; 0: the model's own input shape)."
  ),
  'reference_batch': Flag('Batch size at which training memory is measured.'),
}

REGISTRY: dict[str, Entry] = {
  'fedavg': Entry(
    hparams=fedavg.Hparams,
    factory=fedavg.build,
    label='FedAvg',
    # The FedOpt family of Reddi et al. with the server rates and epsilons
    # (tau) their authors found best on EMNIST CR, their task nearest ours
    # (a small CNN on 28x28 grey images, 10 clients a round): log10 server
    # rate -0.5 (FedAvgM, momentum 0.9), -2.5 (FedAdam, FedYogi; tau 1e-4)
    # and -1 (FedAdagrad; tau 1e-2), from
    # `optimization/docs/hyperparameters.md` of google-research/federated.
    variants={
      'fedavgm': {
        'server_optimizer': 'momentum',
        'server_lr': 10**-0.5,
        'server_momentum': 0.9,
      },
      'fedadam': {
        'server_optimizer': 'adam',
        'server_lr': 10**-2.5,
        'server_epsilon': 1e-4,
      },
      'fedyogi': {
        'server_optimizer': 'yogi',
        'server_lr': 10**-2.5,
        'server_epsilon': 1e-4,
      },
      'fedadagrad': {
        'server_optimizer': 'adagrad',
        'server_lr': 10**-1,
        'server_epsilon': 1e-2,
      },
    },
    variant_labels={
      'fedavgm': 'FedAvgM',
      'fedadam': 'FedAdam',
      'fedyogi': 'FedYogi',
      'fedadagrad': 'FedAdagrad',
    },
    server_optimizer=True,
  ),
  'fedprox': Entry(
    hparams=fedprox.Hparams,
    factory=fedprox.build,
    flags={'mu': Flag('Weight mu of the proximal term (papers: 0.01).')},
    label='FedProx',
    server_optimizer=True,
  ),
  'fedexp': Entry(
    hparams=fedexp.Hparams,
    factory=fedexp.build,
    flags={
      'epsilon': Flag(
        'eps in the step size max(1, sum p_i |D_i|^2 / (2 (|D|^2 + '
        'eps))) (paper: 1e-3); a huge value gives FedAvg.'
      ),
      'average_last_two': Flag(
        'Evaluate the average of the last two global models, as the '
        'paper does (else the last one).'
      ),
    },
    label='FedExP',
    weighting='uniform',
    server_optimizer=True,
  ),
  'fedasam': Entry(
    hparams=fedasam.Hparams,
    factory=fedasam.build,
    flags={
      'rho': Flag(
        'ASAM neighbourhood radius rho (FedASAM authors, CIFAR: 0.7); '
        '0 is FedAvg.'
      ),
      'eta': Flag(
        'ASAM offset eta of the normalisation T = |w| + eta (FedASAM '
        'authors: 0.2).'
      ),
    },
    label='FedASAM',
    server_optimizer=True,
  ),
  'fedsam': Entry(
    hparams=fedasam.SamHparams,
    factory=fedasam.build_sam,
    flags={
      'rho': Flag(
        'SAM neighbourhood radius rho (FedASAM authors, CIFAR-10: '
        '0.1); 0 is FedAvg.'
      ),
    },
    label='FedSAM',
    server_optimizer=True,
  ),
  'fedgen': Entry(
    hparams=fedgen.Hparams,
    factory=fedgen.build,
    flags={
      'noise_dim': Flag('Generator noise size (authors: 32).'),
      'hidden_dim': Flag('Generator hidden layer size (authors, MNIST: 256).'),
      'generator_lr': Flag('Generator Adam learning rate.'),
      'generator_weight_decay': Flag(
        'Generator Adam L2 weight decay (authors: 1e-2).'
      ),
      'generator_steps': Flag('Generator Adam steps per round (authors: 50).'),
      'generator_batch_size': Flag(
        'Labels drawn per generator step (authors: 32).'
      ),
      'ensemble_alpha': Flag(
        "Weight of the heads' (teacher) loss on the server."
      ),
      'ensemble_eta': Flag('Weight of the generator diversity loss.'),
      'generative_alpha': Flag(
        'Client weight of the cross-entropy on generated '
        'representations (decayed per round; 0 with beta 0: FedAvg).'
      ),
      'generative_beta': Flag(
        'Client weight of the KL term between the predictions on '
        'real inputs and on generated representations of their labels.'
      ),
      'decay': Flag('Per-round decay of the two client weights.'),
      'synthetic_batch_size': Flag('Generated representations per local step.'),
    },
    label='FedGen',
    # The README's table runs the authors' client weights α = β = 10 and a
    # tenth of them.
    variants={
      'fedgen_a1': {
        'fedgen_generative_alpha': 1.0,
        'fedgen_generative_beta': 1.0,
      }
    },
  ),
  'clusamp': Entry(
    hparams=clusamp.Hparams,
    factory=clusamp.build,
    flags={
      'method': Flag(
        'How the K distributions are built: "similarity" (Algorithm '
        "2, clients clustered by their last update; the FedMR papers' "
        'choice) or "size" (Algorithm 1, by sample size).',
        choices=clusamp.METHODS,
      ),
      'distance': Flag(
        'Distance between client updates for clusamp_method '
        'similarity: cosine (the angle), l1 or l2.',
        choices=clusamp.DISTANCES,
      ),
    },
    label='CluSamp',
    weighting='uniform',
    variants={'clusamp_size': {'clusamp_method': 'size'}},  # Algorithm 1
    server_optimizer=True,
  ),
  'moon': Entry(
    hparams=moon.Hparams,
    factory=moon.build,
    flags={
      'mu': Flag(
        "Weight mu of the model-contrastive loss (authors' code: 1; "
        "the paper's best for CIFAR-10: 5); 0 is FedAvg."
      ),
      'temperature': Flag(
        'Temperature tau of the contrastive loss (paper: 0.5).'
      ),
      'projection_dim': Flag(
        'Output size of the projection head put before the output '
        'layer (paper: 256); 0: no head, the representation is the input of '
        "the model's last layer."
      ),
    },
    label='MOON',
    model=moon.wrap_model,
    server_optimizer=True,
  ),
  'scaffold': Entry(
    hparams=scaffold.Hparams,
    factory=scaffold.build,
    flags={
      'control_dtype': Flag(
        'Storage dtype of the N client controls (bfloat16 halves '
        'their memory).',
        choices=scaffold.CONTROL_DTYPES,
      ),
      'control_steps': Flag(
        'Step count of the option-II control update: "effective" '
        '(momentum-aware, the number of steps that plain SGD would need for '
        'the same move; equals the steps taken at momentum 0) or "taken" '
        '(the steps taken, the literal formula).',
        choices=scaffold.CONTROL_STEPS,
      ),
    },
    label='SCAFFOLD',
    weighting='uniform',
    # The literal formula.
    variants={'scaffold_taken': {'scaffold_control_steps': 'taken'}},
    server_optimizer=True,
  ),
  'fedmr': Entry(
    hparams=fedmr.Hparams,
    factory=fedmr.build,
    flags=_FEDMR_FLAGS,
    label='FedMR',
    weighting='uniform',
    multi_model=True,
    variants={
      'fedmr_2stage20': {'fedmr_first_stage': 20},
      'fedmr_secure': {'fedmr_secure_repeats': 2},
    },
  ),
  'fedmr_p': Entry(
    hparams=fedmr.PHparams,
    factory=fedmr.build_p,
    flags={
      **_FEDMR_FLAGS,
      'segments': Flag(
        'FedMR-p: number of contiguous segments of layers (in model order) '
        'recombined as units; >= 2 (1 is the algorithm indep).'
      ),
    },
    label='FedMR-p',
    weighting='uniform',
    multi_model=True,
    prefix='fedmr',
    variants={'fedmr_p2': {'fedmr_segments': 2}},
  ),
  'indep': Entry(
    hparams=fedmr.Hparams,
    factory=fedmr.build_indep,
    flags=_FEDMR_FLAGS,
    label='Indep',
    weighting='uniform',
    multi_model=True,
    prefix='fedmr',
  ),
  'fedmut': Entry(
    hparams=fedmut.Hparams,
    factory=fedmut.build,
    flags={
      'alpha': Flag('Mutation range alpha (paper: 4; 5 diverges).'),
      'beta0': Flag(
        'Initial dynamic preference beta_0 (paper: 0.3 for CNN and '
        'VGG-16, 0.5 for ResNet-18).'
      ),
      'bound': Flag('Rounds T_b over which beta decays linearly to 0.'),
      'grouping': _GROUPING._replace(name='fedmr_grouping'),
    },
    label='FedMut',
    weighting='uniform',
    multi_model=True,
    # The alpha ablation.
    variants={
      f'fedmut_a{a:g}': {'fedmut_alpha': float(a)} for a in (0, 1, 2, 4, 5)
    },
    server_optimizer=True,
  ),
  'depthfl': Entry(
    hparams=depthfl.Hparams,
    factory=depthfl.build,
    flags={
      'kd_weight': Flag(
        'Weight of the mutual self-distillation term once ramped up '
        "(authors' code: 1); 0: cross-entropy of the exits only."
      ),
      'kd_rampup': Flag(
        'Rounds over which the distillation weight ramps up as '
        "exp(-5 (1 - r/R)^2) (authors' code: 300); 0: constant."
      ),
      'temperature': Flag("Distillation temperature T (authors' code: 1)."),
      'extended': Flag(
        'Train every exit of the local sub-network (DepthFL); False '
        "trains only its deepest exit (the authors' InclusiveFL-style "
        'baseline).'
      ),
      'inference': Flag(
        "Global prediction: the mean of all exits' logits "
        '("ensemble", the paper) or the deepest exit alone ("last").',
        choices=multi_exit.INFERENCE,
      ),
      'depth': Flag(
        'Depth of every client; 0: from its memory budget (FedStitch '
        'budgets, the deepest sub-network that fits).'
      ),
      'budget_seed': Flag('Seed of the assignment of budgets to clients.'),
    },
    label='DepthFL',
    variants={
      'depthfl_last': {'depthfl_inference': 'last'},
      'depthfl_no_kd': {'depthfl_kd_weight': 0.0},
    },
    model=depthfl.wrap_model,
  ),
  'heterofl': Entry(
    hparams=heterofl.Hparams,
    factory=heterofl.build,
    flags={
      **_BUDGET_FLAGS,
      'rates': Flag(
        'Comma-separated width rates in (0, 1] (paper: 1, 1/2, 1/4, 1/8, 1/16).'
      ),
      'masked_loss': Flag(
        "Zero the logits of classes absent from a client's "
        "data in its loss (the authors' default)."
      ),
      'scaler': Flag(
        'Divide hidden outputs by the rate in training (the paper). '
        'Meant for networks with BatchNorm after each layer: without it the '
        'scale compounds over layers.'
      ),
    },
    label='HeteroFL',
    weighting='uniform',
  ),
  'fedepth': Entry(
    hparams=fedepth.Hparams,
    factory=fedepth.build,
    flags={
      **_BUDGET_FLAGS,
      'layers_per_block': Flag(
        'Layers (residual blocks) per block for every client; 0: each '
        "client's blocks from its memory budget (FedStitch budgets)."
      ),
    },
    label='FeDepth',
  ),
  'ft_full': Entry(
    hparams=finetune.Hparams,
    factory=finetune.build_full,
    flags=_BUDGET_FLAGS,
    label='FT-Full',
    prefix='ft',
  ),
  'ft_part': Entry(
    hparams=finetune.PartHparams,
    factory=finetune.build_part,
    flags={
      **_BUDGET_FLAGS,
      'layers': Flag(
        'FT-Part: how many final parameterised modules (top-level '
        'entries of the params, e.g. the head and the last residual block) '
        'train; the others stay frozen.'
      ),
    },
    label='FT-Part',
    prefix='ft',
  ),
}


def names() -> tuple[str, ...]:
  return tuple(REGISTRY)


def get(name: str) -> Entry:
  if name not in REGISTRY:
    raise KeyError(
      f'unknown algorithm {name!r}; choose one of {", ".join(REGISTRY)}'
    )
  return REGISTRY[name]


def model_for(name: str, model: model_lib.Model, hp: Any) -> model_lib.Model:
  """The network algorithm `name` (hyper-parameters `hp`) trains, built
  from the zoo model `model`."""
  wrap = get(name).model
  return model if wrap is None else wrap(model, hp)


def flags_of(name: str) -> dict[str, HparamFlag]:
  """{flag name: HparamFlag} of algorithm `name`'s hyper-parameters (a
  field its entry gives no `Flag` has no help text)."""
  entry = get(name)
  out = {}
  for f in dataclasses.fields(entry.hparams):
    flag = entry.flags.get(f.name, Flag(''))
    flag_name = flag.name or f'{entry.prefix or name}_{f.name}'
    out[flag_name] = HparamFlag(f, flag.help, flag.choices)
  return out


def all_flags() -> dict[str, tuple[HparamFlag, tuple[str, ...]]]:
  """{flag: (field, the algorithms that read it)} over the registry.

  Raises:
    ValueError: two algorithms define one flag with different defaults or
      types (a registry bug).
  """
  out: dict[str, tuple[HparamFlag, tuple[str, ...]]] = {}
  for name in REGISTRY:
    for flag, f in flags_of(name).items():
      if flag in out:
        first, users = out[flag]
        if (first.default, first.type) != (f.default, f.type):
          raise ValueError(
            f'field `{flag}` is defined twice, differently ({users[0]} and '
            f'{name})'
          )
        out[flag] = (first, users + (name,))
      else:
        out[flag] = (f, (name,))
  return out


def hparams(name: str, values: Mapping[str, Any]) -> Any:
  """Algorithm `name`'s hyper-parameters from flag values (missing flags
  take their defaults)."""
  fields = flags_of(name)
  return get(name).hparams(
    **{
      f.field.name: values[flag] for flag, f in fields.items() if flag in values
    }
  )


def display_name(variant: str) -> str:
  """The name of an algorithm or of one of its named variants in figures.

  An algorithm gives its label ('fedmr' -> 'FedMR'); a variant of an entry
  gives the label and the flags it overrides without their prefix
  ('fedmr_2stage20' -> 'FedMR (first_stage=20)'); any other name (a custom
  variant of `experiments.compare`) is returned as it is.
  """
  if variant in REGISTRY:
    return REGISTRY[variant].label
  for name, entry in REGISTRY.items():
    if variant in entry.variant_labels:
      return entry.variant_labels[variant]
    if variant in entry.variants:
      prefix = f'{entry.prefix or name}_'
      changes = ', '.join(
        f'{flag.removeprefix(prefix)}={value:g}'
        if isinstance(value, float)
        else f'{flag.removeprefix(prefix)}={value}'
        for flag, value in entry.variants[variant].items()
      )
      return f'{entry.label} ({changes})'
  return variant


def variants() -> dict[str, dict[str, Any]]:
  """compare's named variants: each algorithm by its name, and the
  entries' own variants (config overrides)."""
  out: dict[str, dict[str, Any]] = {}
  for name, entry in REGISTRY.items():
    out[name] = {'algorithm': name}
    for variant, overrides in entry.variants.items():
      out[variant] = {'algorithm': name, **overrides}
  return out
