"""roundalign sweep: tiny or hub models x alignment variants x seeds, probe, GRPO, aggregate, figures.

snakemake --cores 2                                                     # CPU smoke sweep (configs/smoke.yaml)
snakemake --profile workflow/profiles/slurm --configfile configs/paper.yaml    # paper sweep on SLURM
snakemake -s workflow/figures.smk --cores 1                             # figures from committed tables only
"""

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

min_version("9.0")


# The CPU smoke sweep is the default; a --configfile with models replaces it (overlays merge onto each
# other), while --config key=value alone (e.g. sweep=demo) only overrides keys of the smoke sweep.
if "models" not in config:

    configfile: "configs/smoke.yaml"


# a short message naming each offending key (and the closest valid one) instead of jsonschema's whole-schema report
from roundalign.training.sweep import explain_schema_errors

_problems = explain_schema_errors(config, "workflow/schemas/sweep.schema.yaml")
if _problems:
    raise WorkflowError(_problems)
validate(config, "workflow/schemas/sweep.schema.yaml", set_default=True)


include: "workflow/rules/figures_common.smk"
include: "workflow/rules/common.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/probe.smk"
include: "workflow/rules/attribute.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        figure_targets(
            SWEEP.name, SWEEP.attribution is not None, SWEEP.stress is not None
        ),
        aggregate_targets(SWEEP.name),
        attribution_outputs(SWEEP.name),
        stress_figure_targets(SWEEP.name, IS_DOSE) if SWEEP.stress else [],
        dose_probe_targets(SWEEP.name),


onsuccess:
    # where a finished sweep put what a reader looks at first (make demo ends here too)
    print(
        f"roundalign sweep {SWEEP.name!r} finished: summary table figures/{SWEEP.name}/summary.md, figures "
        f"figures/{SWEEP.name}/fig_*.png, tables results/{SWEEP.name}/aggregate/, run directories "
        f"{SWEEP.workdir}/runs/{SWEEP.name}/"
    )
