package chart

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	authzv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// checkHostRBACScript runs hack/host-rbac.sh against the test API server as
// if it were Harvester (with stand-ins for Harvester's two ClusterRoles and a
// kube-controller-manager that fills ServiceAccount token Secrets), then uses
// the kubeconfig it wrote: it must authenticate, carry the VM namespace, and
// be allowed exactly what the Harvester roles grant.
func (k *kube) checkHostRBACScript(ctx context.Context, t *testing.T, env *testenv.Env) {
	if _, err := exec.LookPath("kubectl"); err != nil {
		t.Skip("kubectl not installed: hack/host-rbac.sh needs it")
	}
	err := env.Run("kube-controller-manager",
		"--kubeconfig="+env.Kubeconfig,
		"--controllers=serviceaccount-token",
		"--service-account-private-key-file="+filepath.Join(env.Dir, "sa.key"),
		"--root-ca-file="+filepath.Join(env.Dir, "certs", "apiserver.crt"),
		"--use-service-account-credentials=false",
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--secure-port=0",
	)
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join("testdata", "host-roles.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range strings.Split(string(data), "\n---\n") {
		role := &rbacv1.ClusterRole{}
		if err := yaml.UnmarshalStrict([]byte(doc), role); err != nil {
			t.Fatal(err)
		}
		if _, err := k.client.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	const vmNamespace = "guest-vms"
	k.ensureNamespace(ctx, t, vmNamespace)

	out := filepath.Join(t.TempDir(), "cloud-provider-config")
	run := func(args ...string) {
		t.Helper()
		cmd := exec.CommandContext(ctx, "bash", append([]string{filepath.Join(render.RepoRoot(), "hack", "host-rbac.sh")}, args...)...)
		cmd.Env = append(os.Environ(), "KUBECONFIG="+env.Kubeconfig)
		b, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("hack/host-rbac.sh %v: %v\n%s", args, err, b)
		}
	}
	run("--namespace", vmNamespace, "--output", out, "--guest-kubeconfig", env.Kubeconfig)
	run("--namespace", vmNamespace, "--output", out) // idempotent

	raw, err := clientcmd.LoadFromFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if ns := raw.Contexts[raw.CurrentContext].Namespace; ns != vmNamespace {
		t.Errorf("kubeconfig context namespace %q, want %q", ns, vmNamespace)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", out)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Insecure || len(cfg.CAData) == 0 {
		t.Errorf("kubeconfig does not verify the server with a CA (insecure=%v)", cfg.Insecure)
	}
	as, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	can := func(ns, verb, group, resource, sub string) bool {
		t.Helper()
		r, err := as.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authzv1.SelfSubjectAccessReview{Spec: authzv1.SelfSubjectAccessReviewSpec{
			ResourceAttributes: &authzv1.ResourceAttributes{Namespace: ns, Verb: verb, Group: group, Resource: resource, Subresource: sub},
		}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("the written kubeconfig does not authenticate: %v", err)
		}
		return r.Status.Allowed
	}
	for _, c := range []struct {
		ns, verb, group, resource, sub string
		want                           bool
	}{
		{vmNamespace, "update", "subresources.kubevirt.io", "virtualmachines", "addvolume", true},
		{vmNamespace, "watch", "kubevirt.io", "virtualmachineinstances", "", true},
		{vmNamespace, "create", "", "persistentvolumeclaims", "", true},
		{vmNamespace, "patch", "kubevirt.io", "virtualmachines", "", true},
		{"", "get", "harvesterhci.io", "settings", "", true},
		{"", "get", "storage.k8s.io", "storageclasses", "", true},
		{"default", "create", "", "persistentvolumeclaims", "", false},
		{vmNamespace, "get", "", "secrets", "", false},
		{"", "list", "kubevirt.io", "kubevirts", "", false},
	} {
		if got := can(c.ns, c.verb, c.group, c.resource, c.sub); got != c.want {
			t.Errorf("host identity: %s %s/%s/%s in %q allowed=%v, want %v", c.verb, c.group, c.resource, c.sub, c.ns, got, c.want)
		}
	}

	// The guest Secret the chart's cloudConfig.secretName points at.
	s, err := k.client.CoreV1().Secrets("kube-system").Get(ctx, "harvester-cloud-config", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("guest Secret not created: %v", err)
	}
	written, _ := os.ReadFile(out)
	if len(s.Data["cloud-provider-config"]) == 0 {
		t.Error("guest Secret lacks key cloud-provider-config")
	} else if gotNS := namespaceOf(t, s.Data["cloud-provider-config"]); gotNS != vmNamespace || len(written) == 0 {
		t.Errorf("guest Secret kubeconfig namespace %q", gotNS)
	}
}

func namespaceOf(t *testing.T, kubeconfig []byte) string {
	t.Helper()
	c, err := clientcmd.Load(kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	return c.Contexts[c.CurrentContext].Namespace
}
