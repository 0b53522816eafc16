"""``brokerha ctl`` verbs for users, vhosts and permissions, with rabbitmqctl's names,
arguments and words.

- ``add_user NAME PASSWORD``, ``change_password NAME PASSWORD``, ``delete_user NAME``,
  ``set_user_tags NAME [TAG ...]``, ``list_users``;
- ``add_vhost VHOST [--description D] [--tags a,b] [--default-queue-type T]``,
  ``delete_vhost VHOST``, ``list_vhosts``;
- ``set_permissions [-p VHOST] USER CONF WRITE READ``, ``clear_permissions [-p VHOST]
  USER``, ``list_permissions [-p VHOST]``, ``list_user_permissions USER``;
- ``set_topic_permissions [-p VHOST] USER EXCHANGE WRITE READ``,
  ``clear_topic_permissions [-p VHOST] USER``, ``list_topic_permissions [-p VHOST]``.

Each goes to the management API (``/api/users``, ``/api/vhosts``,
``/api/permissions``, ``/api/topic-permissions``: definitions_api.py) of the
serving primary, as an administrator; the change is stored, replicated and
acted on there. A refusal prints rabbitmqctl's words after ``Error:`` (``User
"u" does not exist``, ``User "u" already exists``, ``Virtual host v does not
exist``; for a vhost's verbs ``Virtual host 'v' does not exist``, without ``Error:``, as
rabbitmqctl) and exits 1, as every refused ``brokerha ctl`` command.
``set_user_tags`` keeps the user's password hash; ``add_vhost`` through the
API gives the calling user full permissions in the new vhost, as the
management API does (rabbitmqctl's ``add_vhost`` gives none).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from brokerha.admin.policies_ctl import REFUSED, Serving
from brokerha.httpapi.client import CtlError, request


def _q(name: str) -> str:
    return quote(name, safe="")


def _error(text: str) -> CtlError:
    return CtlError(f"Error:\n{text}", REFUSED)


def _call(base: str, path: str, *, missing: str = "", plain: bool = False, body: Any = None,
          method: str | None = None) -> Any:
    """The API's answer; a 404 as ``missing`` says (``plain``: without ``Error:``, as
    rabbitmqctl's vhost verbs), another refusal with its reason."""
    try:
        return request(base, path, body=body, method=method)
    except CtlError as exc:
        if exc.status is None:
            raise
        if exc.status == 404 and missing:
            raise (CtlError(missing, REFUSED) if plain else _error(missing)) from None
        raise _error(str(exc.reason or exc)) from None


def _no_vhost(vhost: str) -> str:
    return f"Virtual host '{vhost}' does not exist"


def _user(base: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = _call(base, f"/api/users/{_q(name)}",
                                  missing=f'User "{name}" does not exist')
    return found


def _vhost_and_user(base: str, vhost: str, user: str) -> None:
    """rabbitmqctl's words for a permission's unknown user or vhost."""
    _call(base, f"/api/users/{_q(user)}", missing=f"User {user} does not exist")
    _call(base, f"/api/vhosts/{_q(vhost)}", missing=f"Virtual host {vhost} does not exist")


# -- users -----------------------------------------------------------------------------------

def add_user(args: argparse.Namespace, base: str) -> None:
    print(f'Adding user "{args.name}" ...')
    try:
        request(base, f"/api/users/{_q(args.name)}")
    except CtlError as exc:
        if exc.status != 404:
            raise
    else:
        raise _error(f'User "{args.name}" already exists')
    _call(base, f"/api/users/{_q(args.name)}", method="PUT",
          body={"password": args.new_password, "tags": ""})


def change_password(args: argparse.Namespace, base: str) -> None:
    print(f'Changing password for user "{args.name}" ...')
    user = _user(base, args.name)
    _call(base, f"/api/users/{_q(args.name)}", method="PUT",
          body={"password": args.new_password, "tags": user["tags"]})


def delete_user(args: argparse.Namespace, base: str) -> None:
    print(f'Deleting user "{args.name}" ...')
    _call(base, f"/api/users/{_q(args.name)}", method="DELETE",
          missing=f'User "{args.name}" does not exist')


def set_user_tags(args: argparse.Namespace, base: str) -> None:
    print(f'Setting tags for user "{args.name}" to [{", ".join(args.tags)}] ...')
    user = _user(base, args.name)
    _call(base, f"/api/users/{_q(args.name)}", method="PUT",
          body={"password_hash": user["password_hash"],
                "hashing_algorithm": user["hashing_algorithm"], "tags": args.tags})


def list_users(args: argparse.Namespace, base: str) -> None:
    print("Listing users ...")
    _rows(["user", "tags"], [[u["name"], f"[{', '.join(u['tags'])}]"]
                             for u in _call(base, "/api/users")])


# -- vhosts ----------------------------------------------------------------------------------

def add_vhost(args: argparse.Namespace, base: str) -> None:
    print(f'Adding vhost "{args.vhost_name}" ...')
    body: dict[str, Any] = {"description": args.description, "tags": args.tags}
    if args.default_queue_type:
        body["default_queue_type"] = args.default_queue_type
    _call(base, f"/api/vhosts/{_q(args.vhost_name)}", method="PUT", body=body)


def delete_vhost(args: argparse.Namespace, base: str) -> None:
    print(f'Deleting vhost "{args.vhost_name}" ...')
    _call(base, f"/api/vhosts/{_q(args.vhost_name)}", method="DELETE",
          missing=_no_vhost(args.vhost_name), plain=True)


def list_vhosts(args: argparse.Namespace, base: str) -> None:
    print("Listing vhosts ...")
    _rows(["name"], [[v["name"]] for v in _call(base, "/api/vhosts")])


# -- permissions -----------------------------------------------------------------------------

def set_permissions(args: argparse.Namespace, base: str) -> None:
    print(f'Setting permissions for user "{args.name}" in vhost "{args.vhost}" ...')
    _set_grant(base, "permissions", args.vhost, args.name,
               {"configure": args.conf, "write": args.write, "read": args.read})


def clear_permissions(args: argparse.Namespace, base: str) -> None:
    print(f'Clearing permissions for user "{args.name}" in vhost "{args.vhost}" ...')
    _clear_grant(base, "permissions", args.vhost, args.name)


def list_permissions(args: argparse.Namespace, base: str) -> None:
    print(f'Listing permissions for vhost "{args.vhost}" ...')
    _list_grants(base, "permissions", args.vhost, ["configure", "write", "read"])


def list_user_permissions(args: argparse.Namespace, base: str) -> None:
    print(f'Listing permissions for user "{args.name}" ...')
    found = _call(base, f"/api/users/{_q(args.name)}/permissions",
                  missing=f'User "{args.name}" does not exist')
    _rows(["vhost", "configure", "write", "read"],
          [[p["vhost"], p["configure"], p["write"], p["read"]] for p in found])


def set_topic_permissions(args: argparse.Namespace, base: str) -> None:
    print(f'Setting topic permissions on "{args.exchange}" for user "{args.name}" in vhost '
          f'"{args.vhost}" ...')
    _set_grant(base, "topic-permissions", args.vhost, args.name,
               {"exchange": args.exchange, "write": args.write, "read": args.read})


def clear_topic_permissions(args: argparse.Namespace, base: str) -> None:
    print(f'Clearing topic permissions for user "{args.name}" in vhost "{args.vhost}" ...')
    _clear_grant(base, "topic-permissions", args.vhost, args.name)


def list_topic_permissions(args: argparse.Namespace, base: str) -> None:
    print(f'Listing topic permissions for vhost "{args.vhost}" ...')
    _list_grants(base, "topic-permissions", args.vhost, ["exchange", "write", "read"])


# A grant is a user's permissions (``kind`` "permissions") or topic permissions
# ("topic-permissions") in a vhost: the same API paths and the same words for both.

def _set_grant(base: str, kind: str, vhost: str, user: str, body: dict[str, str]) -> None:
    _vhost_and_user(base, vhost, user)
    _call(base, f"/api/{kind}/{_q(vhost)}/{_q(user)}", method="PUT", body=body)


def _clear_grant(base: str, kind: str, vhost: str, user: str) -> None:
    _vhost_and_user(base, vhost, user)
    try:
        request(base, f"/api/{kind}/{_q(vhost)}/{_q(user)}", method="DELETE")
    except CtlError as exc:
        if exc.status != 404:  # none to clear: rabbitmqctl says nothing either
            raise _error(str(exc.reason or exc)) from None


def _list_grants(base: str, kind: str, vhost: str, columns: list[str]) -> None:
    """The vhost's grants of ``kind``, a row a user with its ``columns``."""
    found = _call(base, f"/api/vhosts/{_q(vhost)}/{kind}", missing=_no_vhost(vhost), plain=True)
    _rows(["user", *columns], [[p["user"], *(p[c] for c in columns)] for p in found])


def _rows(header: list[str], rows: list[list[str]]) -> None:
    """rabbitmqctl's table: tab-separated, a header line when there are rows."""
    if rows:
        print("\t".join(header))
    for row in rows:
        print("\t".join(row))


# -- registration --------------------------------------------------------------------------

Verb = Callable[[argparse.Namespace, str], None]


def register(sub: Any, serving: Serving) -> None:
    """The verbs on ``brokerha ctl``'s subparsers; ``serving(node)`` -> (admin URL, name)
    of the serving primary."""

    def verb(name: str, handler: Verb, text: str, *args: str, vhost: bool = False,
             nargs: dict[str, str] | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=f"{text} (administrator)")
        if vhost:
            p.add_argument("-p", "--vhost", default="/", metavar="VHOST")
        for arg in args:
            p.add_argument(arg, nargs=(nargs or {}).get(arg))
        p.set_defaults(ctl_handler=lambda a: handler(a, serving(a.node)[0]) or 0)
        return p

    # the password is new_password: ctl's own --password is the caller's
    verb("add_user", add_user, "add a user with a password", "name", "new_password")
    verb("change_password", change_password, "set a user's password", "name", "new_password")
    verb("delete_user", delete_user, "delete a user (its connections are closed)", "name")
    verb("set_user_tags", set_user_tags, "set a user's tags", "name", "tags",
         nargs={"tags": "*"})
    verb("list_users", list_users, "users and their tags")
    p = verb("add_vhost", add_vhost, "add a vhost", "vhost_name")
    p.add_argument("--description", default="")
    p.add_argument("--tags", default="", help="comma-separated")
    p.add_argument("--default-queue-type", dest="default_queue_type", default=None)
    verb("delete_vhost", delete_vhost, "delete a vhost with its queues and exchanges "
         "(its connections are closed)", "vhost_name")
    verb("list_vhosts", list_vhosts, "the vhosts")
    verb("set_permissions", set_permissions, "set a user's permissions in a vhost",
         "name", "conf", "write", "read", vhost=True)
    verb("clear_permissions", clear_permissions, "clear a user's permissions in a vhost",
         "name", vhost=True)
    verb("list_permissions", list_permissions, "the permissions in a vhost", vhost=True)
    verb("list_user_permissions", list_user_permissions, "a user's permissions", "name")
    verb("set_topic_permissions", set_topic_permissions, "set a user's topic permissions "
         "on an exchange", "name", "exchange", "write", "read", vhost=True)
    verb("clear_topic_permissions", clear_topic_permissions, "clear a user's topic "
         "permissions in a vhost", "name", vhost=True)
    verb("list_topic_permissions", list_topic_permissions, "the topic permissions in a vhost",
         vhost=True)
