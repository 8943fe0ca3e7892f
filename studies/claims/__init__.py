"""The claims ledger: every claim of the paper with the rule that decides it and the
verdict the committed records give (book chapter :ref:`claims`); the one package that
reads several studies."""
