#ifndef UBIQFS_CSTATEMENTCAPTURE_H
#define UBIQFS_CSTATEMENTCAPTURE_H

/* A statement trace on an SQLite connection, in C: GRDB's trace builds and trims Swift strings
   for every statement, which cost a quarter of an unlink. */

typedef void (*ubiq_statement_sink)(void *context, const char *sql);

/* What the trace reports to. `capturing` is read at every statement: while it is non-zero,
   `changed` gets the SQL, with its values in place, of each statement that may write (not a
   read-only statement, not a trigger's program). `observed`, when not NULL, gets the SQL text
   of every statement. Owned by the caller, alive as long as the connection. */
typedef struct {
  int capturing;
  void *context;
  ubiq_statement_sink changed;
  ubiq_statement_sink observed;
} ubiq_statement_trace;

/* Installs the trace on `connection` (a sqlite3 *). Returns SQLite's result code. */
int ubiq_trace_statements(void *connection, ubiq_statement_trace *trace);

#endif
