"""The engines' drafter formats: export to and import from vllm-project/speculators and DeepSpec folders
(see :mod:`dspark_core.formats.common` for the target-layer-id conventions)."""

from dspark_core.formats.common import FORMATS, FormatError, from_format_ids, to_format_ids
from dspark_core.formats.export import check_exportable, export_drafter
from dspark_core.formats.imports import ImportReport, detect_format, import_drafter

__all__ = ["FORMATS", "FormatError", "ImportReport", "check_exportable", "detect_format", "export_drafter",
           "from_format_ids", "import_drafter", "to_format_ids"]
