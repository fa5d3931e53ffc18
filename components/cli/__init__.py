"""`sao` command line: commands.py is the one table of commands (each with its flags and the function it runs),
parser.py builds the parser from it, main.py runs the chosen entry and ends any error with one `sao: ...` line.
The functions sit in run_flows.py (Prefect flows), run_mlflow.py (MLflow's store), run_servers.py (served
endpoints) and run_local.py (the rest), and are imported only after parsing (commands.py).
"""

from components.cli.main import main
from components.cli.parser import build_parser

__all__ = ["build_parser", "main"]
