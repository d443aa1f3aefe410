"""Stored users (DESIGN §4, "The user store"): live state beside the ads, which the index does
not know about.

* `store`: `UserStore`, each stored user's attribute codes and last L engagements, seeded from
  the online features, grown by engagement events, saved into and restored from a snapshot's
  users/ (`write_state`, `read_state`);
* `idempotency`: the idempotency keys of events calls and the digest of a call;
* `organic`: `OrganicEvents`, the organic events the online features hold, by user id;
* `stored`: `StoredUser`, a user as of a request's time, and `read_users`, which reads it
  from a store (one server's, or the owner shard's on a cluster).

A `DurableIndex` (`m31.index.durable`) logs a store's writes beside the ads' through the
`UserState` interface it declares, so that `m31.index` imports nothing from here.
"""

from m31.users.store import Events, UserStore, Vocab

__all__ = ["Events", "UserStore", "Vocab"]
