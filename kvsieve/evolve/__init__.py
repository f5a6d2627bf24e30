"""Policy discovery (CacheCraft-style program evolution): programs, sandbox, cascade evaluator, search loop."""
