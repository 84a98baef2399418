"""Reports of run directories: plots and a diagnosis of a training run, the study plots and table of a tuning run."""

from raytrm.report.build import Report, write_report
from raytrm.report.diagnosis import Finding, diagnose
from raytrm.report.runs import RunRecord, load_run

__all__ = ["Finding", "Report", "RunRecord", "diagnose", "load_run", "write_report"]
