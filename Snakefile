"""roundalign sweep: tiny or hub models x alignment variants x seeds, probe, GRPO, aggregate, figures.

snakemake --cores 2                                                     # CPU smoke sweep (configs/smoke.yaml)
snakemake --profile workflow/profiles/slurm --configfile configs/paper.yaml    # paper sweep on SLURM
snakemake -s workflow/figures.smk --cores 1                             # figures from committed tables only
"""

from snakemake.utils import min_version, validate

min_version("9.0")


# The CPU smoke sweep is the default; a --configfile with models replaces it (overlays merge onto each
# other), while --config key=value alone (e.g. sweep=demo) only overrides keys of the smoke sweep.
if "models" not in config:

    configfile: "configs/smoke.yaml"


validate(config, "workflow/schemas/sweep.schema.yaml", set_default=True)


include: "workflow/rules/figures_common.smk"
include: "workflow/rules/common.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/probe.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        figure_targets(SWEEP.name),
        aggregate_targets(SWEEP.name),
        stress_figure_targets(SWEEP.name) if SWEEP.stress else [],
