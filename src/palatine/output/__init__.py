"""Where output goes: palatine's log lines, the console, and a job's log directory.

`console` formats log records so that every line can be classified on its own, tells
palatine's chatter from a program's output, and writes to a console without ever
blocking; `logs` makes, locks, keeps and prunes the directories jobs log into.
"""
