package chart

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// requiredPermission is one entry of ci/required-guest-permissions.yaml.
type requiredPermission struct {
	ServiceAccount string   `json:"serviceAccount"` // controller or node
	Scope          string   `json:"scope"`          // cluster or namespace
	APIGroup       string   `json:"apiGroup"`
	Resource       string   `json:"resource"`
	Verbs          []string `json:"verbs"`
	UsedBy         []string `json:"usedBy"`
}

// grant is one (identity, scope, group, resource, verb).
type grant struct{ sa, scope, group, resource, verb string }

func (g grant) String() string {
	group := g.group
	if group == "" {
		group = "core"
	}
	return fmt.Sprintf("%s SA: %s %s/%s (%s)", g.sa, g.verb, group, g.resource, g.scope)
}

func loadRequiredPermissions(t *testing.T) ([]requiredPermission, map[grant][]string) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(render.ChartDir(), "ci", "required-guest-permissions.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Permissions []requiredPermission `json:"permissions"`
	}
	if err := yaml.UnmarshalStrict(data, &file); err != nil {
		t.Fatalf("required-guest-permissions.yaml: %v", err)
	}
	want := map[grant][]string{}
	for _, p := range file.Permissions {
		if (p.ServiceAccount != "controller" && p.ServiceAccount != "node") || (p.Scope != "cluster" && p.Scope != "namespace") || p.Resource == "" || len(p.Verbs) == 0 || len(p.UsedBy) == 0 {
			t.Fatalf("required-guest-permissions.yaml: incomplete entry %+v", p)
		}
		for _, v := range p.Verbs {
			g := grant{p.ServiceAccount, p.Scope, p.APIGroup, p.Resource, v}
			want[g] = append(want[g], p.UsedBy...)
		}
	}
	return file.Permissions, want
}

// grantsOf computes what the rendered RBAC grants each of the chart's
// ServiceAccounts, and fails on wildcards or grants to anything else.
func grantsOf(t *testing.T, r *rendered) map[grant]bool {
	t.Helper()
	saRole := map[string]string{controllerSA: "controller", nodeSA: "node"}
	rules := map[string][]rbacv1.PolicyRule{} // "ClusterRole/x" or "Role/x"
	for _, o := range r.ofKind("ClusterRole") {
		rules["ClusterRole/"+o.GetName()] = typed[rbacv1.ClusterRole](t, o).Rules
	}
	for _, o := range r.ofKind("Role") {
		if o.GetNamespace() != render.Namespace {
			t.Errorf("Role %s in namespace %q, want the release namespace", o.GetName(), o.GetNamespace())
		}
		rules["Role/"+o.GetName()] = typed[rbacv1.Role](t, o).Rules
	}
	out := map[grant]bool{}
	bind := func(kind, name string, ref rbacv1.RoleRef, subjects []rbacv1.Subject, scope string) {
		rs, ok := rules[ref.Kind+"/"+ref.Name]
		if !ok {
			t.Errorf("%s %s refers to %s %s, which the chart does not render", kind, name, ref.Kind, ref.Name)
		}
		for _, s := range subjects {
			sa, ok := saRole[s.Name]
			if s.Kind != "ServiceAccount" || !ok || s.Namespace != render.Namespace {
				t.Errorf("%s %s binds %+v, which is not one of the chart's ServiceAccounts", kind, name, s)
				continue
			}
			for _, rule := range rs {
				if len(rule.NonResourceURLs) > 0 || len(rule.ResourceNames) > 0 {
					t.Errorf("%s %s: unexpected rule %+v", ref.Kind, ref.Name, rule)
				}
				for _, g := range rule.APIGroups {
					for _, res := range rule.Resources {
						for _, v := range rule.Verbs {
							if g == "*" || res == "*" || v == "*" {
								t.Errorf("%s %s grants a wildcard: %+v", ref.Kind, ref.Name, rule)
							}
							out[grant{sa, scope, g, res, v}] = true
						}
					}
				}
			}
		}
	}
	for _, o := range r.ofKind("ClusterRoleBinding") {
		b := typed[rbacv1.ClusterRoleBinding](t, o)
		bind("ClusterRoleBinding", b.Name, b.RoleRef, b.Subjects, "cluster")
	}
	for _, o := range r.ofKind("RoleBinding") {
		b := typed[rbacv1.RoleBinding](t, o)
		// A RoleBinding grants only in its namespace, even when it refers to a ClusterRole.
		bind("RoleBinding", b.Name, b.RoleRef, b.Subjects, "namespace")
	}
	return out
}

// TestGuestRBACMatchesRequiredPermissions: the ServiceAccounts get exactly
// what ci/required-guest-permissions.yaml lists: a permission the code needs
// and the chart lacks fails, and so does one the chart grants beyond it.
func TestGuestRBACMatchesRequiredPermissions(t *testing.T) {
	_, want := loadRequiredPermissions(t)
	for _, vs := range valueSets(t) {
		t.Run(vs.name, func(t *testing.T) {
			r := renderSet(t, vs)
			got := grantsOf(t, r)
			deployed := deployedSidecars(t, r)
			var missing, extra []string
			for g, users := range want {
				if !slices.ContainsFunc(users, deployed) {
					continue // only users the chart left out need it
				}
				if !got[g] {
					missing = append(missing, fmt.Sprintf("%s, needed by %s", g, strings.Join(users, ", ")))
				}
			}
			for g := range got {
				if users, ok := want[g]; !ok || !slices.ContainsFunc(users, deployed) {
					extra = append(extra, g.String())
				}
			}
			sort.Strings(missing)
			sort.Strings(extra)
			if len(missing) > 0 {
				t.Errorf("the chart lacks permissions the code needs (add them to templates/rbac.yaml):\n  %s", strings.Join(missing, "\n  "))
			}
			if len(extra) > 0 {
				t.Errorf("the chart grants permissions nothing needs (least privilege; remove them, or list the user in ci/required-guest-permissions.yaml):\n  %s", strings.Join(extra, "\n  "))
			}
		})
	}
}

// deployedSidecars reports whether a user named in the permission list runs
// with these values: an optional sidecar only when the controller pod has its
// container; everything else always.
func deployedSidecars(t *testing.T, r *rendered) func(user string) bool {
	t.Helper()
	var names []string
	for _, o := range r.ofKind("Deployment") {
		names = append(names, containerNames(typed[appsv1.Deployment](t, o).Spec.Template.Spec.Containers)...)
	}
	return func(user string) bool {
		return !slices.Contains(optionalSidecars, user) || slices.Contains(names, user)
	}
}

// TestWorkloadsUseTheirServiceAccounts ties the RBAC identities to the pods.
func TestWorkloadsUseTheirServiceAccounts(t *testing.T) {
	r := renderSet(t, valueSet{name: "default"})
	for _, sa := range []string{controllerSA, nodeSA} {
		if o := r.find("ServiceAccount", sa); o == nil || o.GetNamespace() != render.Namespace {
			t.Errorf("ServiceAccount %s/%s not rendered", render.Namespace, sa)
		}
	}
	names := r.names()
	for _, n := range []string{"ClusterRole/" + controllerSA, "ClusterRoleBinding/" + controllerSA} {
		if !slices.Contains(names, n) {
			t.Errorf("%s missing: upstream's object names must stay", n)
		}
	}
}
