"""Admin for API keys: create one (its secret is shown once, on the page after saving), revoke.

Keys are made and revoked through ``queue_core.auth``, as ``relay keys`` does; the admin never
sees or stores a secret beyond that one response. Only the SHA-256 of a key is stored.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from queue_admin.listing import BoundedChangelist
from queue_api.schemas import iso
from queue_core import auth
from queue_core.models import ApiKey


class ApiKeyCreateForm(forms.ModelForm):  # type: ignore[type-arg]
    """Name and scopes of a new key."""

    scope_choices = forms.MultipleChoiceField(
        label="Scopes",
        choices=[(s, s) for s in auth.SCOPES],
        widget=forms.CheckboxSelectMultiple,
        help_text="producer: submit, inspect, stats. worker: lease, renew, ack, fail, release, "
        "inspect. operator: everything, dead letters included.",
    )

    class Meta:
        model = ApiKey
        fields = ["name"]


class WorkerKeyCreateForm(ApiKeyCreateForm):
    """The creation form of a user who is not a superuser: no ``operator`` scope (a forged
    POST asking for it is refused as an invalid choice)."""

    scope_choices = forms.MultipleChoiceField(
        label="Scopes",
        choices=[(s, s) for s in auth.SCOPES if s != "operator"],
        widget=forms.CheckboxSelectMultiple,
        help_text="producer: submit, inspect, stats. worker: lease, renew, ack, fail, release, "
        "inspect. An operator key (everything, dead letters included) is made by a superuser "
        "or with relay keys create.",
    )


@admin.register(ApiKey)
class ApiKeyAdmin(BoundedChangelist):
    """List, create and revoke API keys; no secret is ever shown after its creation page.
    Its list takes only the declared filter's lookups (``BoundedChangelist``): a review read
    a key's stored hash with ``?secret_sha256__startswith=`` in 511 requests."""

    list_display = ["name", "prefix", "scopes", "created", "last_used", "revoked"]
    list_filter = [("revoked_at_ms", admin.EmptyFieldListFilter)]
    search_fields = ["name", "prefix"]
    actions = ["revoke_keys"]
    readonly_fields = ["prefix", "scopes", "created", "last_used", "revoked"]
    fields = ["name", "prefix", "scopes", "created", "last_used", "revoked"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[ApiKey]:
        """The keys in Relay's database (``auth.keys``), not Django's default alias: a name
        changed here is saved back there too (an instance saves to the database it came
        from)."""
        return auth.keys()

    @admin.display(description="created")
    def created(self, obj: ApiKey) -> str:
        """Creation time, ISO 8601."""
        return iso(obj.created_at_ms) or "-"

    @admin.display(description="last used")
    def last_used(self, obj: ApiKey) -> str:
        """Last use (updated at most once a minute), ISO 8601."""
        return iso(obj.last_used_at_ms) or "-"

    @admin.display(description="revoked")
    def revoked(self, obj: ApiKey) -> str:
        """Revocation time, or ``-`` for an active key."""
        return iso(obj.revoked_at_ms) or "-"

    def has_delete_permission(self, request: HttpRequest, obj: ApiKey | None = None) -> bool:
        """Keys are revoked, never deleted here: with no key row left access control is off
        (every request runs anonymous), so a user allowed to delete keys switched it off for
        every surface (a hostile review). ``relay keys`` deletes none either."""
        return False

    def get_form(
        self, request: HttpRequest, obj: ApiKey | None = None, change: bool = False, **kwargs: Any
    ) -> Any:
        """The creation form asks for scopes (``operator`` only of a superuser: an operator
        key does everything the console's own permissions guard, purge and replay included);
        the change form edits the name only."""
        if obj is None:
            superuser = getattr(request.user, "is_superuser", False)
            kwargs["form"] = ApiKeyCreateForm if superuser else WorkerKeyCreateForm
            kwargs["fields"] = ["name", "scope_choices"]
        return super().get_form(request, obj, change, **kwargs)

    def get_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> Any:
        """Name and scopes on the add page; everything (read-only but the name) on change."""
        if obj is None:
            return ["name", "scope_choices"]
        return self.fields

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> Any:
        """Nothing is read-only on the add page."""
        return [] if obj is None else self.readonly_fields

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """Django's form, but no "save as new" (which it honours even with ``save_as`` off):
        that saved a row with no key and answered 500 (a review). Keys are made on the add
        page only, by ``auth.create_key``.

        Raises:
            PermissionDenied: a POST with ``_saveasnew``.
        """
        if request.method == "POST" and "_saveasnew" in request.POST:
            raise PermissionDenied("API keys are made on the add page")
        return super().changeform_view(request, object_id, form_url, extra_context)

    def add_view(
        self, request: HttpRequest, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """On a valid POST, make the key with ``auth.create_key`` and show it once."""
        if request.method == "POST" and self.has_add_permission(request):
            form = self.get_form(request)(request.POST)
            if form.is_valid():
                new = auth.create_key(form.cleaned_data["name"], form.cleaned_data["scope_choices"])
                self.log_addition(request, auth.keys().get(prefix=new.prefix), "created")
                context = {
                    **self.admin_site.each_context(request),
                    "title": "API key created",
                    "opts": self.opts,
                    "new_key": new,
                }
                response = TemplateResponse(
                    request, "admin/queue_core/apikey/created.html", context
                )
                response["Cache-Control"] = "no-store"
                return response
        return super().add_view(request, form_url, extra_context)

    @admin.action(description="Revoke selected API keys", permissions=["change"])
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        """Revoke each selected key (a revoked key is refused within a second everywhere)."""
        count = 0
        for key in queryset:
            if key.revoked_at_ms is None:
                auth.revoke(key.prefix)
                count += 1
        self.message_user(request, f"Revoked {count} key(s).", messages.SUCCESS)
