//! Applying a store's schema.

use sqlx::Pool;
use sqlx::migrate::Migrator;

use crate::{dialect::StoreSql, error::Error};

/// The table where the stores' `migrate` records the migrations it applied.
pub const MIGRATIONS_TABLE: &str = "_reliq_migrations";

/// Apply `migrator` (a store crate's `sqlx::migrate!`) to `pool`, recording it in
/// [`MIGRATIONS_TABLE`] rather than the application's `_sqlx_migrations`.
pub async fn migrate<S: StoreSql>(
    mut migrator: Migrator,
    pool: &Pool<S::Db>,
) -> Result<(), Error<S>> {
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator.run(pool).await?;
    Ok(())
}
