//! Statement parameters: the placeholders `$1..$n` a statement holds, their types as
//! planned, `?` placeholders (Flight SQL's and JDBC's) numbered into that form, and a row
//! of bound values taken from an Arrow batch.

use crate::error::{Result, SqlError};
use arrow::array::RecordBatch;
use arrow::datatypes::DataType;
use datafusion::common::{ParamValues, ScalarValue};
use datafusion::logical_expr::LogicalPlan;
use datafusion::sql::sqlparser::dialect::GenericDialect;
use datafusion::sql::sqlparser::tokenizer::{Token, Tokenizer};

/// The types of `$1..$n`, in order; `None` where the plan leaves one open.
pub fn positional_types(plan: &LogicalPlan) -> Result<Vec<Option<DataType>>> {
    let inferred = plan.get_parameter_types()?;
    let mut numbered: Vec<(usize, Option<DataType>)> = inferred
        .into_iter()
        .map(|(name, data_type)| {
            name.strip_prefix('$')
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|&n| n > 0)
                .map(|n| (n, data_type))
                .ok_or_else(|| {
                    SqlError::UndefinedParameter(format!(
                        "parameter {name} is not of the form $n (or ?)"
                    ))
                })
        })
        .collect::<Result<_>>()?;
    numbered.sort_by_key(|(n, _)| *n);
    let count = numbered.last().map_or(0, |(n, _)| *n);
    let mut types = vec![None; count];
    for (n, data_type) in numbered {
        types[n - 1] = data_type;
    }
    Ok(types)
}

/// Numbers `?` placeholders `$1`, `$2`, ... in the order they appear, leaving string
/// literals, quoted names and comments alone. SQL without `?` comes back unchanged; SQL
/// mixing `?` with `$n` is refused, as the two numberings would collide.
pub fn number_question_marks(sql: &str) -> Result<String> {
    if !sql.contains('?') {
        return Ok(sql.to_string());
    }
    let tokens = Tokenizer::new(&GenericDialect {}, sql)
        .with_unescape(false)
        .tokenize()
        .map_err(|e| SqlError::Syntax(e.to_string()))?;
    let is_question = |t: &Token| matches!(t, Token::Placeholder(p) if p == "?");
    if !tokens.iter().any(is_question) {
        return Ok(sql.to_string());
    }
    if tokens
        .iter()
        .any(|t| matches!(t, Token::Placeholder(p) if p.starts_with('$')))
    {
        return Err(SqlError::UndefinedParameter(
            "a statement uses ? and $n placeholders together; use one form".into(),
        ));
    }
    let mut next = 0;
    Ok(tokens
        .into_iter()
        .map(|token| {
            if is_question(&token) {
                next += 1;
                format!("${next}")
            } else {
                token.to_string()
            }
        })
        .collect())
}

/// Row `row` of `batch` as the values of `$1..$n`: its columns, in order, one per
/// placeholder.
pub fn row_values(batch: &RecordBatch, row: usize, expected: usize) -> Result<ParamValues> {
    if batch.num_columns() != expected {
        return Err(SqlError::UndefinedParameter(format!(
            "the statement has {expected} parameter(s), but {} value(s) were bound",
            batch.num_columns()
        )));
    }
    let values = batch
        .columns()
        .iter()
        .map(|column| ScalarValue::try_from_array(column, row))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ParamValues::List(
        values.into_iter().map(Into::into).collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn question_marks_are_numbered_outside_literals_and_comments() {
        assert_eq!(
            number_question_marks("SELECT * FROM t WHERE a = ? AND b = 'why?' AND c = ? -- ok?")
                .unwrap(),
            "SELECT * FROM t WHERE a = $1 AND b = 'why?' AND c = $2 -- ok?"
        );
        assert_eq!(
            number_question_marks("SELECT 'it''s' = ?").unwrap(),
            "SELECT 'it''s' = $1",
            "an escaped quote stays escaped"
        );
        assert_eq!(
            number_question_marks("SELECT 'no placeholders?'").unwrap(),
            "SELECT 'no placeholders?'"
        );
        let mixed = number_question_marks("SELECT ? + $1").unwrap_err();
        assert!(mixed.to_string().contains("? and $n"), "{mixed}");
        assert_eq!(mixed.sqlstate(), "42P02");
    }
}
