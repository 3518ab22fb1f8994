package chart

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart"
	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/yaml"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// TestAgainstAPIServer runs the chart against a real kube-apiserver (from
// hack/tools.sh): every rendered object passes a server-side dry-run, a Helm
// release of the upstream chart's shape upgrades in place to this chart, and
// the installed RBAC grants the ServiceAccounts what the code needs.
//
// CRDs: VolumeSnapshotClass is checked against the real snapshot.storage.k8s.io
// CRDs of the external-snapshotter client module (a Go dependency of this
// test). ServiceMonitor and PrometheusRule are checked against stand-in CRDs
// with an open schema (testdata/servicemonitor-crd.yaml,
// testdata/prometheusrule-crd.yaml): the dry-run validates their metadata, the
// strict decoding into the Prometheus Operator's Go types in
// TestEveryObjectMatchesItsAPIType validates their spec.
func TestAgainstAPIServer(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	env, err := testenv.Start(ctx, testenv.Options{Namespace: render.Namespace})
	if err != nil {
		t.Fatalf("start the API server: %v", err)
	}
	t.Cleanup(env.Stop)
	k := newKube(t, env.Config)

	t.Run("crds", func(t *testing.T) { k.installCRDs(ctx, t) })
	for _, vs := range valueSets(t) {
		t.Run("dry-run/"+vs.name, func(t *testing.T) { k.dryRunAll(ctx, t, renderSet(t, vs)) })
	}

	helm := newHelm(t, env.Kubeconfig)
	t.Run("upgrade-from-upstream", func(t *testing.T) { k.upgradeFromUpstream(ctx, t, helm) })
	t.Run("upgrade-preflight-commands", func(t *testing.T) { k.checkUpgradePreflight(ctx, t, env.Kubeconfig) })
	t.Run("rbac-on-server", func(t *testing.T) { k.checkAccessReviews(ctx, t) })
	t.Run("immutable-fields-are-enforced", func(t *testing.T) { k.checkImmutability(ctx, t) })
	t.Run("respects-another-default-storageclass", func(t *testing.T) { k.checkDefaultStorageClass(ctx, t, helm) })
}

type kube struct {
	cfg    *rest.Config
	client kubernetes.Interface
	dyn    dynamic.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
}

func newKube(t *testing.T, cfg *rest.Config) *kube {
	t.Helper()
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &kube{cfg: cfg, client: client, dyn: dyn, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))}
}

func (k *kube) resource(o *unstructured.Unstructured) (dynamic.ResourceInterface, error) {
	gvk := o.GroupVersionKind()
	m, err := k.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return nil, err
	}
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		ns := o.GetNamespace()
		if ns == "" {
			ns = render.Namespace
		}
		return k.dyn.Resource(m.Resource).Namespace(ns), nil
	}
	return k.dyn.Resource(m.Resource), nil
}

func (k *kube) installCRDs(ctx context.Context, t *testing.T) {
	out, err := exec.Command("go", "list", "-mod=mod", "-m", "-f", "{{.Dir}}", "github.com/kubernetes-csi/external-snapshotter/client/v8").Output()
	if err != nil {
		t.Fatalf("locate the external-snapshotter client module: %v", err)
	}
	crdDir := filepath.Join(strings.TrimSpace(string(out)), "config", "crd")
	files := []string{filepath.Join("testdata", "servicemonitor-crd.yaml"), filepath.Join("testdata", "prometheusrule-crd.yaml")}
	for _, n := range []string{"volumesnapshotclasses", "volumesnapshots", "volumesnapshotcontents"} {
		files = append(files, filepath.Join(crdDir, "snapshot.storage.k8s.io_"+n+".yaml"))
	}
	ext, err := apiextensionsclient.NewForConfig(k.cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		crd := &apiextensionsv1.CustomResourceDefinition{}
		if err := yaml.Unmarshal(data, crd); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		if _, err := ext.ApiextensionsV1().CustomResourceDefinitions().Create(ctx, crd, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create CRD %s: %v", crd.Name, err)
		}
		err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			got, err := ext.ApiextensionsV1().CustomResourceDefinitions().Get(ctx, crd.Name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			for _, c := range got.Status.Conditions {
				if c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue {
					return true, nil
				}
			}
			return false, nil
		})
		if err != nil {
			t.Fatalf("CRD %s not established: %v", crd.Name, err)
		}
	}
	k.mapper.Reset()
}

// dryRunAll server-side applies every object with dryRun=All: the API
// server's validation and admission see them, nothing is stored.
func (k *kube) dryRunAll(ctx context.Context, t *testing.T, r *rendered) {
	for _, o := range r.objects {
		if ns := o.GetNamespace(); ns != "" {
			k.ensureNamespace(ctx, t, ns)
		}
		ri, err := k.resource(o)
		if err != nil {
			t.Errorf("%s %s: %v", o.GetKind(), o.GetName(), err)
			continue
		}
		data, err := json.Marshal(o.Object)
		if err != nil {
			t.Fatal(err)
		}
		_, err = ri.Patch(ctx, o.GetName(), types.ApplyPatchType, data, metav1.PatchOptions{
			DryRun: []string{metav1.DryRunAll}, FieldManager: "chart-test", Force: ptr(true),
		})
		if err != nil {
			t.Errorf("the API server rejects %s %s/%s: %v", o.GetKind(), o.GetNamespace(), o.GetName(), err)
		}
	}
}

func (k *kube) ensureNamespace(ctx context.Context, t *testing.T, ns string) {
	_, err := k.client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create namespace %s: %v", ns, err)
	}
}

// helmClient runs Helm actions against the test API server.
type helmClient struct{ cfg *action.Configuration }

func newHelm(t *testing.T, kubeconfig string) *helmClient {
	t.Helper()
	flags := genericclioptions.NewConfigFlags(false)
	flags.KubeConfig = ptr(kubeconfig)
	flags.Namespace = ptr(render.Namespace)
	flags.CacheDir = ptr(t.TempDir())
	cfg := &action.Configuration{}
	if err := cfg.Init(flags, render.Namespace, "secret", func(format string, v ...interface{}) { t.Logf("helm: "+format, v...) }); err != nil {
		t.Fatal(err)
	}
	return &helmClient{cfg: cfg}
}

func (h *helmClient) install(ch *chart.Chart, vals map[string]interface{}) error {
	in := action.NewInstall(h.cfg)
	in.ReleaseName = render.ReleaseName
	in.Namespace = render.Namespace
	in.Timeout = time.Minute
	_, err := in.Run(ch, vals)
	return err
}

func (h *helmClient) upgrade(ch *chart.Chart, vals map[string]interface{}, opts ...func(*action.Upgrade)) error {
	up := action.NewUpgrade(h.cfg)
	for _, o := range opts {
		o(up)
	}
	up.Namespace = render.Namespace
	up.Timeout = time.Minute
	up.MaxHistory = 5
	_, err := up.Run(render.ReleaseName, ch, vals)
	return err
}

// upgradeFromUpstream installs a release shaped like the upstream chart
// (testdata/upstream-shape, a stand-in with upstream's object names,
// selectors and immutable fields) with values written for upstream, including
// a pinned upstream driver image, then `helm upgrade --reset-then-reuse-values`s
// it to this chart. The API server rejects any change of an immutable field
// (workload selectors, CSIDriver attachRequired/podInfoOnMount, StorageClass
// provisioner/parameters/reclaimPolicy/volumeBindingMode), so success means an
// in-place upgrade works. It then rolls back to the upstream release and
// upgrades again, as docs/install.md describes.
func (k *kube) upgradeFromUpstream(ctx context.Context, t *testing.T, h *helmClient) {
	upstream, err := render.Load(filepath.Join("testdata", "upstream-shape"))
	if err != nil {
		t.Fatal(err)
	}
	userValues := map[string]interface{}{
		"replicasCount":    2,
		"hostStorageClass": "longhorn",
		"cloudConfig":      map[string]interface{}{"hostPath": "/var/lib/rancher/rke2/etc/config-files/", "secretName": ""},
		// Pinned by the user for upstream: carried over by --reset-then-reuse-values.
		"image": map[string]interface{}{"harvester": map[string]interface{}{"csiDriver": map[string]interface{}{
			"repository": "rancher/harvester-csi-driver", "tag": "v0.2.9"}}},
	}
	if err := h.install(upstream, userValues); err != nil {
		t.Fatalf("install the upstream-shaped release: %v", err)
	}
	before := map[string]*unstructured.Unstructured{}
	upObjs := renderWith(t, upstream, userValues)
	for _, o := range upObjs {
		ri, err := k.resource(o)
		if err != nil {
			t.Fatal(err)
		}
		live, err := ri.Get(ctx, o.GetName(), metav1.GetOptions{})
		if err != nil {
			t.Fatalf("upstream object %s %s not installed: %v", o.GetKind(), o.GetName(), err)
		}
		before[o.GetKind()+"/"+o.GetName()] = live
	}

	// `helm upgrade --reuse-values` would render with the upstream chart's values.yaml: the chart refuses.
	err = h.upgrade(freshChart(t), nil, func(u *action.Upgrade) { u.ReuseValues = true })
	if err == nil || !strings.Contains(err.Error(), "--reset-then-reuse-values") {
		t.Fatalf("helm upgrade --reuse-values: got %v, want the chart's explanation", err)
	}
	// `helm upgrade --reset-then-reuse-values` keeps the pinned upstream image, whose binary does not know this
	// chart's flags: the chart refuses, saying how to drop the pin, and nothing changes.
	err = h.upgrade(freshChart(t), nil, func(u *action.Upgrade) { u.ResetThenReuseValues = true })
	if err == nil || !strings.Contains(err.Error(), `"rancher/harvester-csi-driver" is not this driver's image`) ||
		!strings.Contains(err.Error(), "--set image.harvester.csiDriver.repository=harvester-csi/harvester-csi-driver") {
		t.Fatalf("helm upgrade --reset-then-reuse-values with upstream's image pinned: got %v, want the chart's refusal", err)
	}
	if ds := k.nodeDriverImage(ctx, t); ds != "rancher/harvester-csi-driver:v0.2.9" {
		t.Fatalf("a refused upgrade changed the DaemonSet's image to %s", ds)
	}
	// `helm upgrade --reset-then-reuse-values` with the pin dropped as the message says: this chart's defaults,
	// the user's other upstream values on top.
	dropPin := map[string]interface{}{"image": map[string]interface{}{"harvester": map[string]interface{}{"csiDriver": map[string]interface{}{
		"repository": "harvester-csi/harvester-csi-driver", "tag": ""}}}}
	upgradeToThisChart := func() {
		t.Helper()
		if err := h.upgrade(freshChart(t), dropPin, func(u *action.Upgrade) { u.ResetThenReuseValues = true }); err != nil {
			t.Fatalf("helm upgrade from the upstream chart's shape fails: %v", err)
		}
		if img, want := k.nodeDriverImage(ctx, t), "harvester-csi/harvester-csi-driver:"+freshChart(t).Metadata.AppVersion; img != want {
			t.Errorf("after the upgrade the node plugin runs %s, want %s", img, want)
		}
	}
	upgradeToThisChart()
	for key, old := range before {
		ri, err := k.resource(old)
		if err != nil {
			t.Fatal(err)
		}
		live, err := ri.Get(ctx, old.GetName(), metav1.GetOptions{})
		if err != nil {
			t.Errorf("%s is gone after the upgrade (upstream's object names must stay): %v", key, err)
			continue
		}
		if live.GetUID() != old.GetUID() {
			t.Errorf("%s was recreated, not upgraded in place", key)
		}
	}
	d, err := k.client.AppsV1().Deployments(render.Namespace).Get(ctx, controllerName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// driver, livenessprobe, provisioner, attacher, resizer, snapshotter
	if *d.Spec.Replicas != 2 || len(d.Spec.Template.Spec.Containers) < 6 {
		t.Errorf("upgraded Deployment: replicas %d, containers %d", *d.Spec.Replicas, len(d.Spec.Template.Spec.Containers))
	}
	for _, c := range d.Spec.Template.Spec.Containers {
		if c.Name == "harvester-csi-driver" {
			if v, _ := argValue(c.Args, "host-storage-class"); v != "longhorn" {
				t.Errorf("upstream's hostStorageClass value did not carry over: --host-storage-class=%q", v)
			}
		}
	}

	// Rolling back to the upstream release (docs/install.md) restores its objects in place, and upgrading
	// again works the same way.
	hist, err := action.NewHistory(h.cfg).Run(render.ReleaseName)
	if err != nil {
		t.Fatal(err)
	}
	upstreamRev := 0
	for _, r := range hist {
		if r.Chart.Metadata.Version == upstream.Metadata.Version && (upstreamRev == 0 || r.Version < upstreamRev) {
			upstreamRev = r.Version
		}
	}
	rb := action.NewRollback(h.cfg)
	rb.Version = upstreamRev
	rb.Timeout = time.Minute
	if err := rb.Run(render.ReleaseName); err != nil {
		t.Fatalf("helm rollback to the upstream revision %d: %v", upstreamRev, err)
	}
	if img := k.nodeDriverImage(ctx, t); img != "rancher/harvester-csi-driver:v0.2.9" {
		t.Errorf("after the rollback the node plugin runs %s, want upstream's", img)
	}
	if _, err := k.client.CoreV1().ServiceAccounts(render.Namespace).Get(ctx, "harvester-csi-driver-node", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the rollback left this chart's ServiceAccount harvester-csi-driver-node behind (err %v)", err)
	}
	for key, old := range before {
		ri, err := k.resource(old)
		if err != nil {
			t.Fatal(err)
		}
		if live, err := ri.Get(ctx, old.GetName(), metav1.GetOptions{}); err != nil || live.GetUID() != old.GetUID() {
			t.Errorf("%s after the rollback: %v (recreated: %v)", key, err, err == nil && live.GetUID() != old.GetUID())
		}
	}
	upgradeToThisChart()
}

// nodeDriverImage is the driver image of the installed node DaemonSet.
func (k *kube) nodeDriverImage(ctx context.Context, t *testing.T) string {
	t.Helper()
	ds, err := k.client.AppsV1().DaemonSets(render.Namespace).Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range ds.Spec.Template.Spec.Containers {
		if c.Name == "harvester-csi-driver" {
			return c.Image
		}
	}
	t.Fatalf("DaemonSet %s has no harvester-csi-driver container", nodeName)
	return ""
}

func renderWith(t *testing.T, ch *chart.Chart, vals map[string]interface{}) []*unstructured.Unstructured {
	t.Helper()
	manifest, err := render.Template(ch, vals)
	if err != nil {
		t.Fatal(err)
	}
	objs, err := render.Objects(manifest)
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

// checkAccessReviews asks the API server's RBAC authorizer, for the installed
// release, whether each ServiceAccount may do what
// ci/required-guest-permissions.yaml lists, and may not do a few things
// nobody needs.
func (k *kube) checkAccessReviews(ctx context.Context, t *testing.T) {
	perms, _ := loadRequiredPermissions(t)
	users := map[string]string{
		"controller": "system:serviceaccount:" + render.Namespace + ":" + controllerSA,
		"node":       "system:serviceaccount:" + render.Namespace + ":" + nodeSA,
	}
	d, err := k.client.AppsV1().Deployments(render.Namespace).Get(ctx, controllerName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	running := containerNames(d.Spec.Template.Spec.Containers)
	for _, p := range perms {
		if !slices.ContainsFunc(p.UsedBy, func(u string) bool { return !slices.Contains(optionalSidecars, u) || slices.Contains(running, u) }) {
			continue // its users are not installed
		}
		res, sub, _ := strings.Cut(p.Resource, "/")
		for _, verb := range p.Verbs {
			ns := ""
			if p.Scope == "namespace" {
				ns = render.Namespace
			}
			attrs := authzv1.ResourceAttributes{Namespace: ns, Verb: verb, Group: p.APIGroup, Resource: res, Subresource: sub}
			if !k.allowed(ctx, t, users[p.ServiceAccount], attrs) {
				t.Errorf("%s may not %s %s/%s in %q; needed by %v", p.ServiceAccount, verb, p.APIGroup, p.Resource, ns, p.UsedBy)
			}
			if p.Scope == "namespace" {
				attrs.Namespace = "default"
				if k.allowed(ctx, t, users[p.ServiceAccount], attrs) {
					t.Errorf("%s may %s %s outside the release namespace", p.ServiceAccount, verb, p.Resource)
				}
			}
		}
	}
	denied := []struct {
		sa    string
		attrs authzv1.ResourceAttributes
	}{
		{"controller", authzv1.ResourceAttributes{Verb: "get", Resource: "secrets"}},
		{"controller", authzv1.ResourceAttributes{Verb: "delete", Resource: "pods"}}, // reads them (RWX unpublish), never changes them
		{"controller", authzv1.ResourceAttributes{Verb: "delete", Group: "storage.k8s.io", Resource: "volumeattachments"}},
		{"controller", authzv1.ResourceAttributes{Verb: "patch", Resource: "nodes"}},
		{"node", authzv1.ResourceAttributes{Verb: "get", Resource: "secrets"}},
		{"node", authzv1.ResourceAttributes{Verb: "list", Resource: "persistentvolumes"}},
		{"node", authzv1.ResourceAttributes{Verb: "patch", Group: "storage.k8s.io", Resource: "volumeattachments"}},
		{"node", authzv1.ResourceAttributes{Verb: "create", Resource: "persistentvolumes"}},
	}
	for _, d := range denied {
		if k.allowed(ctx, t, users[d.sa], d.attrs) {
			t.Errorf("%s may %s %s/%s: nothing needs that", d.sa, d.attrs.Verb, d.attrs.Group, d.attrs.Resource)
		}
	}
}

func (k *kube) allowed(ctx context.Context, t *testing.T, user string, attrs authzv1.ResourceAttributes) bool {
	t.Helper()
	sar := &authzv1.SubjectAccessReview{Spec: authzv1.SubjectAccessReviewSpec{
		User:               user,
		Groups:             []string{"system:serviceaccounts", "system:authenticated"},
		ResourceAttributes: &attrs,
	}}
	got, err := k.client.AuthorizationV1().SubjectAccessReviews().Create(ctx, sar, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return got.Status.Allowed
}

// checkImmutability shows the upgrade test has teeth: the API server here
// does reject a changed selector or CSIDriver field.
func (k *kube) checkImmutability(ctx context.Context, t *testing.T) {
	d, err := k.client.AppsV1().Deployments(render.Namespace).Get(ctx, controllerName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	d.Spec.Selector.MatchLabels["component"] = "something-else"
	d.Spec.Template.Labels["component"] = "something-else"
	_, err = k.client.AppsV1().Deployments(render.Namespace).Update(ctx, d, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
	if !apierrors.IsInvalid(err) {
		t.Errorf("changing the Deployment selector: got %v, want an Invalid (immutable) error", err)
	}
	cd, err := k.client.StorageV1().CSIDrivers().Get(ctx, driverName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cd.Spec.AttachRequired = ptr(false)
	_, err = k.client.StorageV1().CSIDrivers().Update(ctx, cd, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
	if !apierrors.IsInvalid(err) {
		t.Errorf("changing CSIDriver attachRequired: got %v, want an Invalid (immutable) error", err)
	}
	sc, err := k.client.StorageV1().StorageClasses().Get(ctx, "harvester", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sc.Parameters = map[string]string{"hostStorageClass": "x"}
	_, err = k.client.StorageV1().StorageClasses().Update(ctx, sc, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
	if !apierrors.IsInvalid(err) {
		t.Errorf("changing StorageClass parameters: got %v, want an Invalid (immutable) error", err)
	}
}

// checkDefaultStorageClass: when the admin made another StorageClass the
// default, an upgrade does not make "harvester" default again.
func (k *kube) checkDefaultStorageClass(ctx context.Context, t *testing.T, h *helmClient) {
	isDefault := func() string {
		sc, err := k.client.StorageV1().StorageClasses().Get(ctx, "harvester", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return sc.Annotations["storageclass.kubernetes.io/is-default-class"]
	}
	if got := isDefault(); got != "true" {
		t.Fatalf("after install, harvester default=%q, want true", got)
	}
	other := &storagev1.StorageClass{
		ObjectMeta:  metav1.ObjectMeta{Name: "admin-choice", Annotations: map[string]string{"storageclass.kubernetes.io/is-default-class": "true"}},
		Provisioner: "example.com/other",
	}
	if _, err := k.client.StorageV1().StorageClasses().Create(ctx, other, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := h.upgrade(freshChart(t), nil); err != nil {
		t.Fatalf("helm upgrade: %v", err)
	}
	if got := isDefault(); got != "false" {
		t.Errorf("with another default StorageClass, harvester default=%q after upgrade, want false", got)
	}
}

// freshChart loads the chart anew: Helm's upgrade may rewrite the chart's
// values in place (--reuse-values does), so actions must not share the
// cached copy the rendering tests use.
func freshChart(t *testing.T) *chart.Chart {
	t.Helper()
	ch, err := render.Load(render.ChartDir())
	if err != nil {
		t.Fatal(err)
	}
	return ch
}

func ptr[T any](v T) *T { return &v }

// docCommand finds the shell command in docs/install.md that starts with
// prefix (a whole line of a code block, or a `code span`).
func docCommand(t *testing.T, prefix string) string {
	t.Helper()
	doc := readDoc(t, filepath.Join("docs", "install.md"))
	i := strings.Index(doc, prefix)
	if i < 0 {
		t.Fatalf("docs/install.md has no command starting %q", prefix)
	}
	cmd := doc[i:]
	end := strings.IndexAny(cmd, "\n`")
	if end < 0 {
		end = len(cmd)
	}
	return strings.TrimSpace(cmd[:end])
}

// checkUpgradePreflight runs docs/install.md's pre-flight commands for users
// coming from upstream, as written, against objects of each kind they must
// and must not report.
func (k *kube) checkUpgradePreflight(ctx context.Context, t *testing.T, kubeconfig string) {
	run := func(cmdline string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, "bash", "-o", "pipefail", "-c", cmdline)
		cmd.Env = append(os.Environ(), "KUBECONFIG="+kubeconfig)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v\n%s", cmdline, err, out)
		}
		return string(out)
	}
	if _, err := exec.LookPath("kubectl"); err != nil {
		t.Skip("kubectl not installed")
	}
	pv := func(name, driverName string, mode corev1.PersistentVolumeAccessMode) *corev1.PersistentVolume {
		p := &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
				AccessModes: []corev1.PersistentVolumeAccessMode{mode},
				ClaimRef:    &corev1.ObjectReference{Namespace: "apps", Name: name + "-claim"},
			},
		}
		if driverName == "" {
			p.Spec.HostPath = &corev1.HostPathVolumeSource{Path: "/tmp/" + name}
		} else {
			p.Spec.CSI = &corev1.CSIPersistentVolumeSource{Driver: driverName, VolumeHandle: name}
		}
		return p
	}
	for _, p := range []*corev1.PersistentVolume{
		pv("pv-rwx", driverName, corev1.ReadWriteMany), pv("pv-rwo", driverName, corev1.ReadWriteOnce),
		pv("pv-other-rwx", "other.csi.example.com", corev1.ReadWriteMany), pv("pv-hostpath-rwx", "", corev1.ReadWriteMany),
	} {
		if _, err := k.client.CoreV1().PersistentVolumes().Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if out := run(docCommand(t, "kubectl get pv -o jsonpath=")); strings.TrimSpace(out) != `apps/pv-rwx-claim ["ReadWriteMany"]` {
		t.Errorf("the RWX pre-flight printed %q, want only apps/pv-rwx-claim", out)
	}

	va := func(name, attacher, pvName string, finalizers []string) *storagev1.VolumeAttachment {
		return &storagev1.VolumeAttachment{
			ObjectMeta: metav1.ObjectMeta{Name: name, Finalizers: finalizers},
			Spec: storagev1.VolumeAttachmentSpec{Attacher: attacher, NodeName: "guest-1",
				Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pvName}},
		}
	}
	vas := k.client.StorageV1().VolumeAttachments()
	for _, v := range []*storagev1.VolumeAttachment{
		va("va-stuck", driverName, "pv-rwo", []string{"external-attacher/driver-harvesterhci-io"}),
		va("va-attached", driverName, "pv-rwx", nil),
		va("va-other", "other.csi.example.com", "pv-other-rwx", nil),
	} {
		created, err := vas.Create(ctx, v, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		created.Status.Attached = v.Name != "va-stuck"
		if v.Name == "va-stuck" {
			created.Status.DetachError = &storagev1.VolumeError{Message: "removal in progress"}
		}
		if _, err := vas.UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := vas.Delete(ctx, "va-stuck", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	out := run(docCommand(t, "kubectl get volumeattachments -o jsonpath="))
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "va-attached pv=pv-rwx node=guest-1 attached=true deleting= ") ||
		!strings.HasPrefix(lines[1], "va-stuck pv=pv-rwo node=guest-1 attached=false deleting=20") || !strings.Contains(lines[1], "detachError=removal in progress") {
		t.Errorf("the VolumeAttachment pre-flight printed:\n%s", out)
	}
	run(strings.ReplaceAll(docCommand(t, "kubectl patch volumeattachment <name>"), "<name>", "va-stuck"))
	if _, err := vas.Get(ctx, "va-stuck", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("va-stuck is still there after the documented finalizer removal: %v", err)
	}
}
