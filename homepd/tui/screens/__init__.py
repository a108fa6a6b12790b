"""One screen per task: dashboard, advise, chat tester, history (and a run from it), help, confirmation."""
