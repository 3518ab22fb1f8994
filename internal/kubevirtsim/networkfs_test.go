package kubevirtsim

import (
	"context"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/dynamic"
)

func newNetworkFS(name, desired string) *unstructured.Unstructured {
	spec := map[string]any{"desiredState": desired, "provisioner": "Longhorn"}
	if name != "" {
		spec["networkFSName"] = name
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "harvesterhci.io/v1beta1", "kind": "NetworkFilesystem",
		"metadata": map[string]any{"name": name, "namespace": NetworkFSNamespace},
		"spec":     spec,
	}}
}

func nfsStatus(u *unstructured.Unstructured) (state, endpoint, status string) {
	state, _, _ = unstructured.NestedString(u.Object, "status", "state")
	endpoint, _, _ = unstructured.NestedString(u.Object, "status", "endpoint")
	status, _, _ = unstructured.NestedString(u.Object, "status", "status")
	return state, endpoint, status
}

// waitStates watches a NetworkFilesystem until its status.state is last and
// returns every distinct state seen on the way, in order.
func waitStates(ctx context.Context, t *testing.T, dyn dynamic.Interface, name, last string) ([]string, *unstructured.Unstructured) {
	t.Helper()
	res := dyn.Resource(networkFSGVR).Namespace(NetworkFSNamespace)
	cur, err := res.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var seen []string
	note := func(u *unstructured.Unstructured) bool {
		st, _, _ := nfsStatus(u)
		if len(seen) == 0 || seen[len(seen)-1] != st {
			seen = append(seen, st)
		}
		return st == last
	}
	if note(cur) {
		return seen, cur
	}
	w, err := res.Watch(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String(), ResourceVersion: cur.GetResourceVersion()})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	for {
		select {
		case <-ctx.Done():
			t.Fatalf("NetworkFilesystem %s never reached %s; states seen %v", name, last, seen)
		case ev, ok := <-w.ResultChan():
			if !ok {
				t.Fatalf("watch ended; states seen %v", seen)
			}
			if u, isU := ev.Object.(*unstructured.Unstructured); isU && note(u) {
				return seen, u
			}
		}
	}
}

func setDesired(ctx context.Context, t *testing.T, dyn dynamic.Interface, name, desired string) {
	t.Helper()
	res := dyn.Resource(networkFSGVR).Namespace(NetworkFSNamespace)
	cur, err := res.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_ = unstructured.SetNestedField(cur.Object, desired, "spec", "desiredState")
	if _, err := res.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// The CRD refuses what networkfs-manager's refuses: no networkFSName, a
// status state outside its enum.
func TestNetworkFSCRDValidates(t *testing.T) {
	t.Parallel()
	s, _ := testSim(t, Options{})
	ctx := testCtx(t, 30*time.Second)
	res := s.c.dyn.Resource(networkFSGVR).Namespace(NetworkFSNamespace)
	bad := newNetworkFS("", "Disabled")
	bad.SetName("nfs-crd-no-name")
	if _, err := res.Create(ctx, bad, metav1.CreateOptions{}); !apierrors.IsInvalid(err) {
		t.Fatalf("create without spec.networkFSName: %v, want Invalid", err)
	}
	obj, err := res.Create(ctx, newNetworkFS("nfs-crd-enum", "Disabled"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = res.Delete(context.Background(), obj.GetName(), metav1.DeleteOptions{}) })
	_ = unstructured.SetNestedField(obj.Object, map[string]any{"state": "Bogus", "status": "Ready", "type": "NFS", "endpoint": ""}, "status")
	if _, err := res.UpdateStatus(ctx, obj, metav1.UpdateOptions{}); !apierrors.IsInvalid(err) {
		t.Fatalf("status state Bogus: %v, want Invalid", err)
	}
}

// networkfs-manager's cycle: a new NetworkFilesystem is initialised
// Disabled; Enabled goes through Enabling to Enabled with an endpoint and
// status Ready; Disabled goes through Disabling back to Disabled, endpoint
// cleared.
func TestNetworkFSEnableDisable(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{NFSMountOptions: "vers=4.1,noresvport"})
	ctx := testCtx(t, 60*time.Second)
	pvc, err := s.CreatePVC(ctx, ns, "rwx-a", "1Gi", false)
	if err != nil {
		t.Fatal(err)
	}
	name := pvc.Spec.VolumeName
	res := s.c.dyn.Resource(networkFSGVR).Namespace(NetworkFSNamespace)
	if _, err := res.Create(ctx, newNetworkFS(name, "Disabled"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = res.Delete(context.Background(), name, metav1.DeleteOptions{}) })

	_, u := waitStates(ctx, t, s.c.dyn, name, "Disabled")
	if _, ep, _ := nfsStatus(u); ep != "" {
		t.Errorf("new export has endpoint %q", ep)
	}

	setDesired(ctx, t, s.c.dyn, name, "Enabled")
	seen, u := waitStates(ctx, t, s.c.dyn, name, "Enabled")
	if len(seen) < 2 || seen[len(seen)-2] != "Enabling" {
		t.Errorf("states on enable %v, want ... Enabling, Enabled", seen)
	}
	if _, ep, st := nfsStatus(u); ep != DefaultNFSEndpoint || st != "Ready" {
		t.Errorf("enabled export: endpoint %q status %q, want %q Ready", ep, st, DefaultNFSEndpoint)
	}
	if opts, _, _ := unstructured.NestedString(u.Object, "status", "mountOpts"); opts != "vers=4.1,noresvport" {
		t.Errorf("mountOpts %q, want the configured ones", opts)
	}

	setDesired(ctx, t, s.c.dyn, name, "Disabled")
	seen, u = waitStates(ctx, t, s.c.dyn, name, "Disabled")
	if len(seen) < 2 || seen[len(seen)-2] != "Disabling" {
		t.Errorf("states on disable %v, want ... Disabling, Disabled", seen)
	}
	if _, ep, st := nfsStatus(u); ep != "" || st != "NotReady" {
		t.Errorf("disabled export: endpoint %q status %q, want none, NotReady", ep, st)
	}

	// And back: a second enable works the same.
	setDesired(ctx, t, s.c.dyn, name, "Enabled")
	if _, u = waitStates(ctx, t, s.c.dyn, name, "Enabled"); func() bool { _, ep, _ := nfsStatus(u); return ep == "" }() {
		t.Error("re-enabled export has no endpoint")
	}
}
