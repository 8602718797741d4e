#include <sqlite3.h>
#include <stddef.h>

#include "CStatementCapture.h"

static int ubiq_trace(unsigned type, void *context, void *p, void *x) {
  ubiq_statement_trace *trace = context;
  sqlite3_stmt *statement = p;
  const char *text = x;
  if (type != SQLITE_TRACE_STMT) return 0;
  /* A trigger's program comes as "-- TRIGGER name": its statement already came. */
  if (text != NULL && text[0] == '-' && text[1] == '-') return 0;
  if (trace->observed != NULL) trace->observed(trace->context, sqlite3_sql(statement));
  if (!trace->capturing || sqlite3_stmt_readonly(statement)) return 0;
  char *expanded = sqlite3_expanded_sql(statement);
  if (expanded == NULL) {
    /* Out of memory, or longer than SQLite's length limit: an empty capture is noticed. */
    trace->changed(trace->context, "");
    return 0;
  }
  trace->changed(trace->context, expanded);
  sqlite3_free(expanded);
  return 0;
}

int ubiq_trace_statements(void *connection, ubiq_statement_trace *trace) {
  return sqlite3_trace_v2(connection, SQLITE_TRACE_STMT, ubiq_trace, trace);
}
