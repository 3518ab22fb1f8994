package rbac

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	appsv1 "k8s.io/api/apps/v1"
	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"
	sigsyaml "sigs.k8s.io/yaml"

	"github.com/harvester-csi/harvester-csi-driver/internal/checkout"
	"github.com/harvester-csi/harvester-csi-driver/internal/csiattacher"
	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	kvbackend "github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/nodeid"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// grant is one verb on one resource: the unit hack/host-rbac.sh grants and
// docs/host-rbac.md explains.
type grant struct {
	Cluster bool // cluster-wide; else in the VM namespace
	// Harvester: in harvester-system (networkfs-manager's NetworkFilesystems).
	Harvester bool
	Group     string // "" is the core group
	Resource  string // resource[/subresource]
	Verb      string
	Names     string // resource names, comma-separated; "" for any

	// Longhorn: in longhorn-system (Longhorn's volumes, --storage-read).
	Longhorn bool
}

func (g grant) String() string {
	where := "VM namespace"
	if g.Cluster {
		where = "cluster"
	}
	if g.Harvester {
		where = "harvester-system"
	}
	if g.Longhorn {
		where = "longhorn-system"
	}
	s := fmt.Sprintf("%s %s %s/%s", where, g.Verb, orCore(g.Group), g.Resource)
	if g.Names != "" {
		s += " (" + g.Names + ")"
	}
	return s
}

func orCore(group string) string {
	if group == "" {
		return "core"
	}
	return group
}

// repoRoot is the checkout's root (internal/repo).
func repoRoot(t testing.TB) string {
	t.Helper()
	root, err := checkout.Root()
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// script runs hack/host-rbac.sh and returns its stdout; stderr is logged.
func script(t *testing.T, ctx context.Context, args ...string) string {
	t.Helper()
	cmd := exec.CommandContext(ctx, "bash", append([]string{filepath.Join(repoRoot(t), "hack", "host-rbac.sh")}, args...)...)
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	t.Logf("hack/host-rbac.sh %s:\n%s", strings.Join(args, " "), stderr.String())
	if err != nil {
		t.Fatalf("hack/host-rbac.sh %v: %v", args, err)
	}
	return stdout.String()
}

// scriptGrants is what the script's default mode grants (with --print, no
// cluster), by role kind.
func scriptGrants(t *testing.T, args ...string) (grants []grant, objects []map[string]interface{}) {
	t.Helper()
	out := script(t, context.Background(), append([]string{"--namespace", "guests", "--print"}, args...)...)
	dec := yaml.NewYAMLOrJSONDecoder(strings.NewReader(out), 4096)
	for {
		obj := map[string]interface{}{}
		if err := dec.Decode(&obj); err != nil {
			break
		}
		if len(obj) == 0 {
			continue
		}
		objects = append(objects, obj)
		kind := obj["kind"]
		if kind != "Role" && kind != "ClusterRole" {
			continue
		}
		harvester := obj["metadata"].(map[string]interface{})["namespace"] == "harvester-system"
		longhorn := obj["metadata"].(map[string]interface{})["namespace"] == "longhorn-system"
		b, _ := json.Marshal(obj)
		var role rbacv1.ClusterRole
		if err := json.Unmarshal(b, &role); err != nil {
			t.Fatal(err)
		}
		for _, r := range role.Rules {
			for _, g := range r.APIGroups {
				for _, res := range r.Resources {
					for _, v := range r.Verbs {
						grants = append(grants, grant{Cluster: kind == "ClusterRole", Harvester: harvester, Longhorn: longhorn, Group: g, Resource: res, Verb: v, Names: strings.Join(r.ResourceNames, ",")})
					}
				}
			}
		}
	}
	if len(objects) == 0 {
		t.Fatalf("hack/host-rbac.sh --print printed no objects:\n%s", out)
	}
	return grants, objects
}

// documentedGrants parses the rules table of docs/host-rbac.md.
func documentedGrants(t *testing.T) []grant {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join(repoRoot(t), "docs", "host-rbac.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(doc), "## The rules, and the calls that need them")
	if !ok {
		t.Fatal(`docs/host-rbac.md has no "## The rules, and the calls that need them" section`)
	}
	section, _, _ = strings.Cut(section, "\n## ")
	code := regexp.MustCompile("`([^`]*)`")
	var out []grant
	for _, line := range strings.Split(section, "\n") {
		cells := strings.Split(strings.Trim(strings.TrimSpace(line), "|"), "|")
		if len(cells) != 5 || strings.HasPrefix(strings.TrimSpace(cells[0]), "---") || strings.TrimSpace(cells[0]) == "where" {
			continue
		}
		g := grant{Cluster: strings.HasPrefix(strings.TrimSpace(cells[0]), "cluster"), Harvester: strings.Contains(cells[0], "harvester-system"),
			Longhorn: strings.Contains(cells[0], "longhorn-system")}
		grp, res, verb := code.FindStringSubmatch(cells[1]), code.FindAllStringSubmatch(cells[2], -1), code.FindStringSubmatch(cells[3])
		if grp == nil || res == nil || verb == nil || strings.TrimSpace(cells[4]) == "" {
			t.Fatalf("docs/host-rbac.md: row %q needs `group`, `resource` (and `name`s), `verb` and the calls", line)
		}
		g.Group, g.Resource, g.Verb = strings.Trim(grp[1], `"`), res[0][1], verb[1]
		var names []string
		for _, n := range res[1:] {
			names = append(names, n[1])
		}
		g.Names = strings.Join(names, ",")
		out = append(out, g)
	}
	if len(out) < 10 {
		t.Fatalf("found only %d rules in docs/host-rbac.md", len(out))
	}
	return out
}

func sortedStrings[T fmt.Stringer](in []T) []string {
	out := make([]string, 0, len(in))
	for _, x := range in {
		out = append(out, x.String())
	}
	sort.Strings(out)
	return out
}

// TestHostRBACScriptGrantsWhatTheDocsExplain: every verb the script grants has
// a row in docs/host-rbac.md naming the calls that need it, and the other way
// round. Namespaced rules are a Role in the VM namespace; nothing is a
// wildcard; nothing binds Harvester's own (broader) roles.
func TestHostRBACScriptGrantsWhatTheDocsExplain(t *testing.T) {
	grants, objects := scriptGrants(t, "--kubevirt-read", "--storage-read")
	if got, want := sortedStrings(grants), sortedStrings(documentedGrants(t)); !slices.Equal(got, want) {
		t.Errorf("hack/host-rbac.sh grants:\n  %s\ndocs/host-rbac.md explains:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
	for _, g := range grants {
		if strings.Contains(g.Group+g.Resource+g.Verb, "*") {
			t.Errorf("wildcard grant %v", g)
		}
	}
	for _, o := range objects {
		meta := o["metadata"].(map[string]interface{})
		if o["kind"] == "Role" || o["kind"] == "RoleBinding" || o["kind"] == "ServiceAccount" {
			// Only NetworkFilesystems are granted in Harvester's namespace, only Longhorn's volumes in Longhorn's.
			nfs := strings.Contains(fmt.Sprint(meta["name"]), "networkfilesystems") && o["kind"] != "ServiceAccount"
			lh := strings.Contains(fmt.Sprint(meta["name"]), "longhorn-reader") && o["kind"] != "ServiceAccount"
			if nfs && meta["namespace"] != "harvester-system" {
				t.Errorf("%s %s is not in harvester-system", o["kind"], meta["name"])
			}
			if lh && meta["namespace"] != "longhorn-system" {
				t.Errorf("%s %s is not in longhorn-system", o["kind"], meta["name"])
			}
			if !nfs && !lh && meta["namespace"] != "guests" {
				t.Errorf("%s %s is not in the VM namespace", o["kind"], meta["name"])
			}
		}
		if ref, ok := o["roleRef"].(map[string]interface{}); ok && strings.HasPrefix(fmt.Sprint(ref["name"]), "harvesterhci.io:") {
			t.Errorf("%s %s binds Harvester's role %s", o["kind"], meta["name"], ref["name"])
		}
	}
}

// callUntilFinal repeats a CSI call, as the sidecars do, until its answer is
// final.
func callUntilFinal(ctx context.Context, call func(ctx context.Context) error) error {
	var err error
	if perr := testwait.PollEvery(ctx, 100*time.Millisecond, "a final answer", func() (bool, string, error) {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err = call(cctx)
		cancel()
		switch status.Code(err) {
		case codes.OK, codes.InvalidArgument, codes.NotFound, codes.FailedPrecondition, codes.AlreadyExists, codes.PermissionDenied, codes.OutOfRange:
			return true, "", nil
		}
		return false, fmt.Sprint(err), nil
	}); perr != nil {
		return perr
	}
	return err
}

// attacher calls as the external-attacher does (internal/csiattacher),
// returning the first answer it takes as final.
func attacher(ctx context.Context, c csi.ControllerClient, call csiattacher.Call) error {
	cfg := csiattacher.Defaults()
	cfg.Workers, cfg.Timeout, cfg.RetryStart, cfg.RetryMax = 0, 10*time.Second, 100*time.Millisecond, time.Second
	return csiattacher.New(cfg, func() csi.ControllerClient { return c }).DoUntil(ctx, call, csiattacher.Final)
}

var blockRWO = &csi.VolumeCapability{
	AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
	AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
}

func publish(ctx context.Context, c csi.ControllerClient, vm, vol string) error {
	return attacher(ctx, c, csiattacher.PublishCall(&csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: vm, VolumeCapability: blockRWO}))
}

func unpublish(ctx context.Context, c csi.ControllerClient, vm, vol string) error {
	return attacher(ctx, c, csiattacher.UnpublishCall(vm, vol))
}

func createVolume(ctx context.Context, t *testing.T, c csi.ControllerClient, name string, snapshot string) string {
	t.Helper()
	req := &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{blockRWO},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}}
	if snapshot != "" {
		req.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snapshot}}}
	}
	var id string
	err := callUntilFinal(ctx, func(ctx context.Context) error {
		r, err := c.CreateVolume(ctx, req)
		if err == nil {
			id = r.GetVolume().GetVolumeId()
		}
		return err
	})
	if err != nil {
		t.Fatalf("CreateVolume %s: %v", name, err)
	}
	return id
}

// controllerFlows drives every controller call the driver serves (and the
// node plugin's VM discovery) through the host identity the controller runs
// as: any call the identity may not make fails here.
func controllerFlows(ctx context.Context, t *testing.T, h *framework.Host, ctrl *framework.Controller, hc *host.Client, vm, prefix string) {
	t.Helper()
	c := ctrl.Client
	vol := createVolume(ctx, t, c, prefix+"-vol", "")
	if err := publish(ctx, c, vm, vol); err != nil {
		t.Fatalf("publish %s to %s: %v", vol, vm, err)
	}
	if err := callUntilFinal(ctx, func(ctx context.Context) error {
		_, err := c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vol, CapacityRange: &csi.CapacityRange{RequiredBytes: 128 << 20}, VolumeCapability: blockRWO})
		return err
	}); err != nil {
		t.Errorf("expand %s: %v", vol, err)
	}
	var snapID string
	if err := callUntilFinal(ctx, func(ctx context.Context) error {
		r, err := c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: vol, Name: prefix + "-snap"})
		if err == nil && !r.GetSnapshot().GetReadyToUse() {
			return status.Error(codes.Unavailable, "not ready yet")
		}
		snapID = r.GetSnapshot().GetSnapshotId()
		return err
	}); err != nil {
		t.Fatalf("snapshot %s: %v", vol, err)
	}
	if r, err := c.ListSnapshots(ctx, &csi.ListSnapshotsRequest{}); err != nil || len(r.GetEntries()) == 0 {
		t.Errorf("ListSnapshots: %v entries, %v", len(r.GetEntries()), err)
	}
	restored := createVolume(ctx, t, c, prefix+"-restored", snapID)
	backupFlow(ctx, t, c, vol, prefix)
	lv, err := c.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Errorf("ListVolumes: %v", err)
	}
	published := false
	for _, e := range lv.GetEntries() {
		published = published || (e.GetVolume().GetVolumeId() == vol && slices.Contains(e.GetStatus().GetPublishedNodeIds(), vm))
	}
	if !published {
		t.Errorf("ListVolumes does not show %s on %s: %v", vol, vm, lv.GetEntries())
	}
	if err := unpublish(ctx, c, vm, vol); err != nil {
		t.Errorf("unpublish %s from %s: %v", vol, vm, err)
	}
	if _, err := c.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snapID}); err != nil {
		t.Errorf("DeleteSnapshot: %v", err)
	}
	for _, v := range []string{vol, restored} {
		if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v}); err != nil {
			t.Errorf("DeleteVolume %s: %v", v, err)
		}
	}

	rwxFlow(ctx, t, c, vm, prefix)

	// The guest node monitor's fresh read before it fences a Node: the VMI,
	// and for a VMI that is gone or ended the VM's virt-launcher pods (the
	// simulator runs none).
	if stopped, why, err := hc.GuestStopped(ctx, vm); err != nil || stopped {
		t.Errorf("guest node monitor: GuestStopped(%s) = %v (%s), %v; want a running guest read without refusal", vm, stopped, why, err)
	}
	if pods, err := hc.LiveLauncherPods(ctx, vm); err != nil || len(pods) != 0 {
		t.Errorf("guest node monitor: launcher pods of %s: %v, %v; want none, read without refusal", vm, pods, err)
	}

	// The node plugin finds its VM with the same identity.
	src := nodeid.KubeVirtSource(hc.KubeVirt.KubevirtV1().VirtualMachineInstances(hc.Namespace))
	if vmi, err := src.GetVMI(ctx, vm); err != nil || vmi == nil {
		t.Errorf("node ID discovery: get VMI %s: %v", vm, err)
	}
	if list, err := src.ListVMIs(ctx); err != nil || len(list) == 0 {
		t.Errorf("node ID discovery: list VMIs: %d, %v", len(list), err)
	}
}

// backupFlow takes a backup snapshot of vol, lists it, restores a volume from
// it and deletes both, as the snapshotter and provisioner would.
func backupFlow(ctx context.Context, t *testing.T, c csi.ControllerClient, vol, prefix string) {
	t.Helper()
	var id string
	if err := callUntilFinal(ctx, func(ctx context.Context) error {
		r, err := c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: vol, Name: prefix + "-backup", Parameters: map[string]string{"type": "backup"}})
		if err == nil && !r.GetSnapshot().GetReadyToUse() {
			return status.Error(codes.Unavailable, "not ready yet")
		}
		id = r.GetSnapshot().GetSnapshotId()
		return err
	}); err != nil {
		t.Fatalf("backup %s: %v", vol, err)
	}
	r, err := c.ListSnapshots(ctx, &csi.ListSnapshotsRequest{})
	if err != nil || !slices.ContainsFunc(r.GetEntries(), func(e *csi.ListSnapshotsResponse_Entry) bool { return e.GetSnapshot().GetSnapshotId() == id }) {
		t.Errorf("ListSnapshots does not list the backup %s: %v", id, err)
	}
	restored := createVolume(ctx, t, c, prefix+"-from-backup", id)
	if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: restored}); err != nil {
		t.Errorf("DeleteVolume %s: %v", restored, err)
	}
	if _, err := c.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: id}); err != nil {
		t.Errorf("DeleteSnapshot %s: %v", id, err)
	}
}

// refusedVolumeFlow: in legacy KubeVirt a webhook may refuse the VM update
// behind an accepted addvolume; the driver must withdraw the refused request
// (virtualmachines/status) and take the volume off the VMI
// (virtualmachineinstances/removevolume), or every later hotplug of that VM
// waits behind it.
func refusedVolumeFlow(ctx context.Context, t *testing.T, h *framework.Host, ctrl *framework.Controller, vm, prefix string) {
	t.Helper()
	c := ctrl.Client
	bad := createVolume(ctx, t, c, prefix+"-refused", "")
	good := createVolume(ctx, t, c, prefix+"-after", "")
	h.Sim.Faults().DenyVolume(bad, "")
	defer h.Sim.Faults().AllowVolume(bad)
	if err := publish(ctx, c, vm, bad); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("publish of the refused volume: %v, want FailedPrecondition", err)
	}
	kv := kubevirt.NewForConfigOrDie(h.Env.Config)
	cleaned, cancelCleaned := context.WithTimeout(ctx, 30*time.Second)
	defer cancelCleaned()
	testwait.Until(cleaned, t, "the refused volume to leave the VM's requests and the VMI (the identity cleaning it up)", func() (bool, string) {
		v, err := kv.KubevirtV1().VirtualMachines(h.Namespace).Get(ctx, vm, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		vmi, err := kv.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, vm, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		_, onVMI := kubevirtsim.FindVolumeStatus(vmi, bad)
		requested := slices.ContainsFunc(v.Status.VolumeRequests, func(r kubevirtv1.VirtualMachineVolumeRequest) bool {
			return r.AddVolumeOptions != nil && r.AddVolumeOptions.Name == bad
		})
		return !requested && !onVMI, fmt.Sprintf("requested %v, on the VMI %v", requested, onVMI)
	})
	if err := publish(ctx, c, vm, good); err != nil {
		t.Errorf("publish after a refused volume: %v", err)
	}
	if err := unpublish(ctx, c, vm, good); err != nil {
		t.Errorf("unpublish %s: %v", good, err)
	}
	for _, v := range []string{bad, good} {
		if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v}); err != nil {
			t.Errorf("DeleteVolume %s: %v", v, err)
		}
	}
}

// usedGrants is what the driver's requests through the simulator's front
// proxy needed, and the requests it was refused.
func usedGrants(st kubevirtsim.Stats) (used map[grant]bool, forbidden []string) {
	used = map[grant]bool{}
	for k, answers := range st.Answers {
		res := k.Resource
		if k.Subresource != "" {
			res += "/" + k.Subresource
		}
		g := grant{Group: k.Group, Resource: res, Verb: k.Verb}
		for code, n := range answers {
			if code == 403 && n > 0 {
				forbidden = append(forbidden, g.String())
			}
			if code < 400 {
				used[g] = true
			}
		}
	}
	return used, forbidden
}

// tokenLifetime reads the lifetime of the bearer token of a kubeconfig.
func tokenLifetime(t *testing.T, token string) time.Duration {
	t.Helper()
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		t.Fatalf("the kubeconfig's token is not a JWT: %q", token)
	}
	b, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		t.Fatal(err)
	}
	var claims struct{ Exp, Iat int64 }
	if err := json.Unmarshal(b, &claims); err != nil {
		t.Fatal(err)
	}
	if claims.Exp == 0 {
		t.Fatal("the token never expires")
	}
	return time.Duration(claims.Exp-claims.Iat) * time.Second
}

func accessReview(ctx context.Context, t *testing.T, as kubernetes.Interface, attrs authzv1.ResourceAttributes) bool {
	t.Helper()
	r, err := as.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authzv1.SelfSubjectAccessReview{
		Spec: authzv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &attrs}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return r.Status.Allowed
}

// TestHostIdentityRunsTheDriver creates the driver's host identity with
// hack/host-rbac.sh on a simulated Harvester, runs the controller as that
// identity through every flow of both hotplug backends, and checks least
// privilege: no request of the driver was refused, every granted verb was
// needed by some flow, and the identity can touch nothing outside the VM
// namespace. Then it rotates the token and grants an existing identity shaped
// like Rancher's only what it lacks.
func TestHostIdentityRunsTheDriver(t *testing.T) {
	if _, err := exec.LookPath("kubectl"); err != nil {
		t.Skip("kubectl not installed: hack/host-rbac.sh needs it")
	}
	granted, _ := scriptGrants(t)
	used := map[grant]bool{}
	for _, f := range []struct {
		name    string
		mode    kubevirtsim.Mode
		version kubevirtsim.Version
		backend string
	}{
		// As Harvester ships them: 1.7 runs KubeVirt 1.6.3 with legacy
		// hotplug, 1.8 runs 1.7.0 with declarative hotplug (the
		// server-version setting says which, when the identity may not
		// read the KubeVirt CR).
		{"legacy", kubevirtsim.ModeLegacy, kubevirtsim.V1_6_3, kvbackend.BackendSubresource},
		{"declarative", kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0, kvbackend.BackendDeclarative},
	} {
		t.Run(f.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			h := framework.StartHost(t, kubevirtsim.Options{Mode: f.mode, Version: f.version, Scale: 0.05, BindClasslessPVCs: true})
			admin := h.Kube
			h.CreateVMs(t, "rbac-vm")
			legacy := createLegacyObjects(ctx, t, admin, h.Namespace)

			dir := t.TempDir()
			out := filepath.Join(dir, "cloud-provider-config")
			base := []string{"--host-kubeconfig", h.Env.Kubeconfig, "--namespace", h.Namespace}
			script(t, ctx, append(base, "--output", out, "--token-duration", "2h")...)
			script(t, ctx, append(base, "--output", out, "--token-duration", "2h")...) // idempotent
			for _, o := range legacy {
				if err := o.get(ctx); !apierrors.IsNotFound(err) {
					t.Errorf("%s, made by the old script, is still there (err %v)", o.name, err)
				}
			}

			hc, err := host.Load(out, 50, 100)
			if err != nil {
				t.Fatalf("load the written kubeconfig: %v", err)
			}
			if hc.Namespace != h.Namespace {
				t.Errorf("kubeconfig namespace %q, want %q", hc.Namespace, h.Namespace)
			}
			written, err := clientcmd.BuildConfigFromFlags("", out)
			if err != nil {
				t.Fatal(err)
			}
			if life := tokenLifetime(t, written.BearerToken); life <= 0 || life > 2*time.Hour {
				t.Errorf("token lifetime %v, want at most the 2h asked for", life)
			}
			// The driver reads the same expiry from the token it was given
			// (harvester_csi_host_token_expiry_timestamp_seconds).
			if exp, ok := hc.TokenExpiry(); !ok || time.Until(exp) <= 0 || time.Until(exp) > 2*time.Hour {
				t.Errorf("the driver's view of the token's expiry: %v (known %t), want within the 2h asked for", exp, ok)
			}
			secrets, err := admin.CoreV1().Secrets(h.Namespace).List(ctx, metav1.ListOptions{})
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range secrets.Items {
				if s.Type == corev1.SecretTypeServiceAccountToken {
					t.Errorf("Secret %s holds a token that never expires", s.Name)
				}
			}

			// The same identity through the simulator's front proxy, which serves KubeVirt's subresources (a
			// kubeconfig cannot point there: client-go sends no token to a plain-HTTP server).
			viaProxy := rest.AnonymousClientConfig(hc.Config)
			viaProxy.Host, viaProxy.TLSClientConfig, viaProxy.BearerToken = h.Sim.ProxyURL(), rest.TLSClientConfig{}, written.BearerToken
			proxied, err := host.NewForConfig(viaProxy, hc.Namespace)
			if err != nil {
				t.Fatal(err)
			}
			h.Sim.ResetStats()
			ctrl := h.StartController(t, framework.ControllerOptions{Backend: kvbackend.BackendAuto, Config: viaProxy,
				Queue:  hotplug.Config{BatchWindow: 50 * time.Millisecond, MaxHold: 2 * time.Second},
				Driver: driver.ControllerOptions{HostStorageClass: "longhorn"}})
			if got := ctrl.Queue.BackendName(); got != f.backend {
				t.Errorf("backend detected as the identity: %s, want %s", got, f.backend)
			}
			controllerFlows(ctx, t, h, ctrl, proxied, "rbac-vm", "pvc-"+f.name)
			if f.mode == kubevirtsim.ModeLegacy {
				refusedVolumeFlow(ctx, t, h, ctrl, "rbac-vm", "pvc-"+f.name)
			}
			ctrl.Stop()
			u, forbidden := usedGrants(h.Sim.Stats())
			for g := range u {
				used[g] = true
			}
			for _, g := range forbidden {
				// Listing the KubeVirt CR is optional (--kubevirt-read); the driver falls back to Harvester's version.
				if g != (grant{Group: "kubevirt.io", Resource: "kubevirts", Verb: "list"}).String() {
					t.Errorf("the driver was refused: %s", g)
				}
			}

			checkConfined(ctx, t, h, proxied)
			checkRotation(ctx, t, h, base, written.BearerToken)
			if f.mode == kubevirtsim.ModeLegacy {
				checkExistingServiceAccount(ctx, t, h, base)
			}
			checkRevoke(ctx, t, h, base, f.mode == kubevirtsim.ModeLegacy)
		})
	}
	if t.Failed() {
		return
	}
	for _, g := range granted {
		g.Cluster, g.Harvester, g.Longhorn, g.Names = false, false, false, ""
		if !used[g] {
			t.Errorf("granted but never needed by the driver's flows: %s", g)
		}
	}
}

// checkConfined: the identity reaches nothing outside its VM namespace, and
// inside it nothing the driver does not use.
func checkConfined(ctx context.Context, t *testing.T, h *framework.Host, hc *host.Client) {
	t.Helper()
	const other = "other-guests"
	if _, err := h.Kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: other}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.Sim.CreateVM(ctx, kubevirtsim.VMSpec{Namespace: other, Name: "foreign-vm", NoWait: true}); err != nil {
		t.Fatal(err)
	}
	vms := hc.KubeVirt.KubevirtV1().VirtualMachines(other)
	patch := []byte(`[{"op":"add","path":"/metadata/labels/touched","value":"yes"}]`)
	if _, err := vms.Patch(ctx, "foreign-vm", types.JSONPatchType, patch, metav1.PatchOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("patch of a VM in another namespace: %v, want Forbidden", err)
	}
	if err := vms.AddVolume(ctx, "foreign-vm", &kubevirtv1.AddVolumeOptions{Name: "x", Disk: &kubevirtv1.Disk{Name: "x"},
		VolumeSource: &kubevirtv1.HotplugVolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
			PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: "x"}}}}); !apierrors.IsForbidden(err) {
		t.Errorf("addvolume on a VM in another namespace: %v, want Forbidden", err)
	}
	as := hc.Kube
	for _, c := range []struct {
		attrs authzv1.ResourceAttributes
		want  bool
	}{
		{authzv1.ResourceAttributes{Namespace: hc.Namespace, Verb: "patch", Group: "kubevirt.io", Resource: "virtualmachines"}, true},
		{authzv1.ResourceAttributes{Namespace: "", Verb: "patch", Group: "kubevirt.io", Resource: "virtualmachines"}, false},
		{authzv1.ResourceAttributes{Namespace: other, Verb: "update", Group: "subresources.kubevirt.io", Resource: "virtualmachines", Subresource: "removevolume"}, false},
		{authzv1.ResourceAttributes{Namespace: other, Verb: "create", Resource: "persistentvolumeclaims"}, false},
		{authzv1.ResourceAttributes{Namespace: hc.Namespace, Verb: "delete", Group: "kubevirt.io", Resource: "virtualmachines"}, false},
		{authzv1.ResourceAttributes{Namespace: hc.Namespace, Verb: "get", Resource: "secrets"}, false},
		{authzv1.ResourceAttributes{Namespace: hc.Namespace, Verb: "list", Resource: "pods"}, true},
		{authzv1.ResourceAttributes{Namespace: hc.Namespace, Verb: "get", Resource: "pods"}, false},
		{authzv1.ResourceAttributes{Namespace: hc.Namespace, Verb: "watch", Resource: "pods"}, false},
		{authzv1.ResourceAttributes{Namespace: other, Verb: "list", Resource: "pods"}, false},
		{authzv1.ResourceAttributes{Namespace: hc.Namespace, Verb: "patch", Resource: "persistentvolumeclaims"}, false},
		{authzv1.ResourceAttributes{Namespace: hc.Namespace, Verb: "create", Group: "harvesterhci.io", Resource: "volumeremotebackups"}, true},
		{authzv1.ResourceAttributes{Namespace: other, Verb: "get", Group: "harvesterhci.io", Resource: "volumeremotebackups"}, false},
		{authzv1.ResourceAttributes{Namespace: hc.Namespace, Verb: "update", Group: "harvesterhci.io", Resource: "volumeremotebackups"}, false},
		{authzv1.ResourceAttributes{Namespace: hc.Namespace, Verb: "list", Group: "harvesterhci.io", Resource: "volumeremoterestores"}, false},
		{authzv1.ResourceAttributes{Verb: "get", Group: "harvesterhci.io", Resource: "settings", Name: "server-version"}, true},
		{authzv1.ResourceAttributes{Verb: "get", Group: "harvesterhci.io", Resource: "settings", Name: "backup-target"}, false},
		{authzv1.ResourceAttributes{Verb: "list", Group: "harvesterhci.io", Resource: "settings"}, false},
		{authzv1.ResourceAttributes{Verb: "list", Group: "storage.k8s.io", Resource: "storageclasses"}, false},
		{authzv1.ResourceAttributes{Verb: "list", Group: "kubevirt.io", Resource: "kubevirts"}, false},
		{authzv1.ResourceAttributes{Namespace: "harvester-system", Verb: "update", Group: "harvesterhci.io", Resource: "networkfilesystems"}, true},
		{authzv1.ResourceAttributes{Namespace: "harvester-system", Verb: "update", Group: "harvesterhci.io", Resource: "networkfilesystems", Subresource: "status"}, false},
		{authzv1.ResourceAttributes{Namespace: hc.Namespace, Verb: "create", Group: "harvesterhci.io", Resource: "networkfilesystems"}, false},
		{authzv1.ResourceAttributes{Verb: "list", Group: "harvesterhci.io", Resource: "networkfilesystems"}, false},
		{authzv1.ResourceAttributes{Namespace: "harvester-system", Verb: "get", Resource: "secrets"}, false},
		{authzv1.ResourceAttributes{Namespace: "harvester-system", Verb: "get", Group: "harvesterhci.io", Resource: "settings", Name: "backup-target"}, false},
	} {
		if got := accessReview(ctx, t, as, c.attrs); got != c.want {
			t.Errorf("host identity: %s %s/%s/%s %q in %q: allowed=%v, want %v", c.attrs.Verb, orCore(c.attrs.Group), c.attrs.Resource, c.attrs.Subresource, c.attrs.Name, c.attrs.Namespace, got, c.want)
		}
	}
}

// checkRotation: --rotate issues a new token into the guest Secret and, with
// --restart, restarts the driver's workloads; the grants stay as they are.
func checkRotation(ctx context.Context, t *testing.T, h *framework.Host, base []string, oldToken string) {
	t.Helper()
	// The guest cluster is the same API server here: its driver workloads, reduced to what a restart touches.
	guest := h.Kube
	labels := map[string]string{"app": "csi"}
	tmpl := corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "driver"}}}}
	deploy := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "harvester-csi-driver-controllers", Namespace: "kube-system"},
		Spec: appsv1.DeploymentSpec{Selector: &metav1.LabelSelector{MatchLabels: labels}, Template: tmpl}}
	if _, err := guest.AppsV1().Deployments("kube-system").Create(ctx, deploy, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	script(t, ctx, append(base, "--rotate", "--guest-kubeconfig", h.Env.Kubeconfig, "--restart", "--token-duration", "1h")...)
	s, err := guest.CoreV1().Secrets("kube-system").Get(ctx, "harvester-cloud-config", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("guest Secret: %v", err)
	}
	kc, err := clientcmd.Load(s.Data["cloud-provider-config"])
	if err != nil {
		t.Fatal(err)
	}
	ctxName := kc.Contexts[kc.CurrentContext]
	newToken := kc.AuthInfos[ctxName.AuthInfo].Token
	if ctxName.Namespace != h.Namespace || newToken == "" || newToken == oldToken {
		t.Errorf("after --rotate the guest Secret has namespace %q and a new token: %v", ctxName.Namespace, newToken != "" && newToken != oldToken)
	}
	if life := tokenLifetime(t, newToken); life > time.Hour {
		t.Errorf("rotated token lifetime %v, want at most 1h", life)
	}
	cfg := &rest.Config{Host: h.Sim.ProxyURL(), BearerToken: newToken}
	review, err := kubernetes.NewForConfigOrDie(cfg).AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil || review.Status.UserInfo.Username != "system:serviceaccount:"+h.Namespace+":harvester-csi-driver" {
		t.Errorf("the rotated token authenticates as %v (%v)", review, err)
	}
	d, err := guest.AppsV1().Deployments("kube-system").Get(ctx, deploy.Name, metav1.GetOptions{})
	if err != nil || d.Spec.Template.Annotations["kubectl.kubernetes.io/restartedAt"] == "" {
		t.Errorf("--restart did not restart %s (err %v)", deploy.Name, err)
	}
}

// checkExistingServiceAccount: an identity shaped like the one Rancher creates
// (Harvester's cloudprovider role in the namespace, its csi-driver role
// cluster-wide) gets exactly what it lacks, the virtualmachines/status patch,
// and then runs the refused-volume flow that needs it.
func checkExistingServiceAccount(ctx context.Context, t *testing.T, h *framework.Host, base []string) {
	t.Helper()
	admin := h.Kube
	data, err := os.ReadFile(filepath.Join("testdata", "host-roles.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range strings.Split(string(data), "\n---\n") {
		role := &rbacv1.ClusterRole{}
		if err := sigsyaml.UnmarshalStrict([]byte(doc), role); err != nil {
			t.Fatal(err)
		}
		if _, err := admin.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	const sa = "rancher-guest"
	subject := []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa, Namespace: h.Namespace}}
	if _, err := admin.CoreV1().ServiceAccounts(h.Namespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.RbacV1().RoleBindings(h.Namespace).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: sa},
		RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "harvesterhci.io:cloudprovider"}, Subjects: subject}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: h.Namespace + "-" + sa},
		RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "harvesterhci.io:csi-driver"}, Subjects: subject}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	script(t, ctx, append(base, "--existing-service-account", sa)...)
	script(t, ctx, append(base, "--existing-service-account", sa)...) // idempotent: the grant made stays
	role, err := admin.RbacV1().Roles(h.Namespace).Get(ctx, sa+"-harvester-csi-driver", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("no Role with the missing grants: %v", err)
	}
	want := []rbacv1.PolicyRule{{APIGroups: []string{"kubevirt.io"}, Resources: []string{"virtualmachines/status"}, Verbs: []string{"patch"}}}
	if !equalRules(role.Rules, want) {
		t.Errorf("Role %s grants %v, want only %v", role.Name, role.Rules, want)
	}
	crs, err := admin.RbacV1().ClusterRoles().List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=" + h.Namespace + "." + sa})
	if err != nil || len(crs.Items) != 0 {
		t.Errorf("ClusterRoles made for an identity that lacks nothing cluster-wide: %v (%v)", crs.Items, err)
	}
	if _, err := admin.CoreV1().ServiceAccounts(h.Namespace).Get(ctx, "harvester-csi-driver", metav1.GetOptions{}); err != nil {
		t.Fatal(err) // made by the default mode earlier; --existing-service-account must not have needed it
	}

	// The driver as that identity, with a token as Rancher's kubeconfig would carry.
	tr, err := admin.CoreV1().ServiceAccounts(h.Namespace).CreateToken(ctx, sa, &authnv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: kvbackend.BackendAuto, Config: &rest.Config{Host: h.Sim.ProxyURL(), BearerToken: tr.Status.Token},
		Queue: hotplug.Config{BatchWindow: 50 * time.Millisecond, MaxHold: 2 * time.Second}})
	defer ctrl.Stop()
	refusedVolumeFlow(ctx, t, h, ctrl, "rbac-vm", "pvc-rancher")
}

// identityObjects names every object of any kind that carries the script's
// labels for the identity ns/sa, as "kind namespace/name".
func identityObjects(ctx context.Context, t *testing.T, kube kubernetes.Interface, ns, sa string) []string {
	t.Helper()
	opts := metav1.ListOptions{LabelSelector: "app.kubernetes.io/managed-by=harvester-csi-driver-host-rbac,app.kubernetes.io/instance=" + ns + "." + sa}
	var out []string
	add := func(kind string, metas []metav1.ObjectMeta, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range metas {
			out = append(out, kind+" "+m.Namespace+"/"+m.Name)
		}
	}
	sas, err := kube.CoreV1().ServiceAccounts("").List(ctx, opts)
	add("ServiceAccount", metas(sas.Items, func(o corev1.ServiceAccount) metav1.ObjectMeta { return o.ObjectMeta }), err)
	rbs, err := kube.RbacV1().RoleBindings("").List(ctx, opts)
	add("RoleBinding", metas(rbs.Items, func(o rbacv1.RoleBinding) metav1.ObjectMeta { return o.ObjectMeta }), err)
	roles, err := kube.RbacV1().Roles("").List(ctx, opts)
	add("Role", metas(roles.Items, func(o rbacv1.Role) metav1.ObjectMeta { return o.ObjectMeta }), err)
	crbs, err := kube.RbacV1().ClusterRoleBindings().List(ctx, opts)
	add("ClusterRoleBinding", metas(crbs.Items, func(o rbacv1.ClusterRoleBinding) metav1.ObjectMeta { return o.ObjectMeta }), err)
	crs, err := kube.RbacV1().ClusterRoles().List(ctx, opts)
	add("ClusterRole", metas(crs.Items, func(o rbacv1.ClusterRole) metav1.ObjectMeta { return o.ObjectMeta }), err)
	return out
}

func metas[T any](items []T, meta func(T) metav1.ObjectMeta) []metav1.ObjectMeta {
	out := make([]metav1.ObjectMeta, 0, len(items))
	for _, o := range items {
		out = append(out, meta(o))
	}
	return out
}

// sharedRoles are the roles hack/host-rbac.sh shares between identities, by
// whether they exist now.
func sharedRoles(ctx context.Context, t *testing.T, kube kubernetes.Interface) map[string]bool {
	t.Helper()
	exists := func(err error) bool {
		t.Helper()
		if err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
		return err == nil
	}
	_, errNFS := kube.RbacV1().Roles("harvester-system").Get(ctx, "harvester-csi-driver:networkfilesystems", metav1.GetOptions{})
	_, errReads := kube.RbacV1().ClusterRoles().Get(ctx, "harvester-csi-driver:host-reads", metav1.GetOptions{})
	return map[string]bool{"Role harvester-system/harvester-csi-driver:networkfilesystems": exists(errNFS),
		"ClusterRole harvester-csi-driver:host-reads": exists(errReads)}
}

// checkRevoke: --revoke deletes the ServiceAccount and every binding the
// script made for it (in the VM namespace, in harvester-system, cluster-wide),
// so its token is refused; the roles shared with another guest cluster's
// identity stay until that one is revoked too. With an existing identity
// (Rancher's) only the script's own grants go, never the account.
func checkRevoke(ctx context.Context, t *testing.T, h *framework.Host, base []string, withExisting bool) {
	t.Helper()
	admin := h.Kube
	const sa, other = "harvester-csi-driver", "revoke-other-guests"
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: other}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	otherBase := []string{"--host-kubeconfig", h.Env.Kubeconfig, "--namespace", other}
	script(t, ctx, append(otherBase, "--output", filepath.Join(t.TempDir(), "other"), "--kubevirt-read")...)
	// Bind the optional KubeVirt read too, so that its binding has to go as well.
	script(t, ctx, append(base, "--output", filepath.Join(t.TempDir(), "again"), "--kubevirt-read")...)
	if len(identityObjects(ctx, t, admin, h.Namespace, sa)) < 5 {
		t.Fatalf("before --revoke the identity has only %v", identityObjects(ctx, t, admin, h.Namespace, sa))
	}

	tr, err := admin.CoreV1().ServiceAccounts(h.Namespace).CreateToken(ctx, sa, &authnv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	whoami := func() error {
		cfg := &rest.Config{Host: h.Sim.ProxyURL(), BearerToken: tr.Status.Token}
		_, err := kubernetes.NewForConfigOrDie(cfg).AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
		return err
	}
	if err := whoami(); err != nil {
		t.Fatalf("the identity's token before --revoke: %v", err)
	}

	out := script(t, ctx, append(base, "--revoke")...)
	for _, want := range []string{"serviceaccount/" + sa, "rolebinding.rbac.authorization.k8s.io/" + sa + " in " + h.Namespace,
		"rolebinding.rbac.authorization.k8s.io/" + h.Namespace + "-" + sa + "-networkfilesystems in harvester-system",
		"clusterrolebinding.rbac.authorization.k8s.io/" + h.Namespace + "-" + sa + "-host-reads",
		"clusterrolebinding.rbac.authorization.k8s.io/" + h.Namespace + "-" + sa + "-kubevirt-reader",
		"role/harvester-csi-driver in " + h.Namespace} {
		if !strings.Contains(out, "deleted "+want) {
			t.Errorf("--revoke printed\n%s\nwithout %q", out, "deleted "+want)
		}
	}
	if left := identityObjects(ctx, t, admin, h.Namespace, sa); len(left) > 0 {
		t.Errorf("after --revoke the identity's objects remain: %v", left)
	}
	if _, err := admin.RbacV1().Roles(h.Namespace).Get(ctx, "harvester-csi-driver", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the VM namespace's Role, bound by no one after --revoke, is still there (err %v)", err)
	}
	for role, exists := range sharedRoles(ctx, t, admin) {
		if !exists {
			t.Errorf("--revoke deleted %s, which the identity of namespace %s still uses", role, other)
		}
	}
	testwait.Until(ctx, t, "the API server to refuse the revoked identity's token", func() (bool, string) {
		err := whoami()
		return apierrors.IsUnauthorized(err), fmt.Sprintf("the token's request answered %v", err)
	})

	if withExisting {
		const rancher = "rancher-guest"
		script(t, ctx, append(base, "--existing-service-account", rancher, "--revoke")...)
		if left := identityObjects(ctx, t, admin, h.Namespace, rancher); len(left) > 0 {
			t.Errorf("after --revoke of an existing identity the script's grants remain: %v", left)
		}
		if _, err := admin.CoreV1().ServiceAccounts(h.Namespace).Get(ctx, rancher, metav1.GetOptions{}); err != nil {
			t.Errorf("--revoke of an existing identity deleted the account itself, which the script did not make (err %v)", err)
		}
		if _, err := admin.RbacV1().RoleBindings(h.Namespace).Get(ctx, rancher, metav1.GetOptions{}); err != nil {
			t.Errorf("--revoke of an existing identity deleted a binding the script did not make (err %v)", err)
		}
	}

	script(t, ctx, append(otherBase, "--revoke")...)
	if left := identityObjects(ctx, t, admin, other, sa); len(left) > 0 {
		t.Errorf("after --revoke of %s its objects remain: %v", other, left)
	}
	for role, exists := range sharedRoles(ctx, t, admin) {
		if exists {
			t.Errorf("%s is still there after the last identity using it was revoked", role)
		}
	}
	if _, err := admin.RbacV1().ClusterRoles().Get(ctx, "harvester-csi-driver:kubevirt-reader", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("ClusterRole harvester-csi-driver:kubevirt-reader is still there after every identity was revoked (err %v)", err)
	}
}

func equalRules(a, b []rbacv1.PolicyRule) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return string(ja) == string(jb)
}

// legacyObject is something the earlier host-rbac.sh made.
type legacyObject struct {
	name string
	get  func(ctx context.Context) error
}

// createLegacyObjects makes what the earlier version of hack/host-rbac.sh
// made: Harvester's csi-driver role bound cluster-wide, its cloudprovider
// role in the namespace, a Role for virtualmachines/status and a token
// Secret that never expires.
func createLegacyObjects(ctx context.Context, t *testing.T, kube kubernetes.Interface, ns string) []legacyObject {
	t.Helper()
	const sa = "harvester-csi-driver"
	labels := map[string]string{"app.kubernetes.io/managed-by": "harvester-csi-driver-host-rbac"}
	meta := func(name, namespace string) metav1.ObjectMeta {
		return metav1.ObjectMeta{Name: name, Namespace: namespace, Labels: labels}
	}
	subject := []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa, Namespace: ns}}
	must := func(_ interface{}, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(kube.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: meta(sa, ns)}, metav1.CreateOptions{}))
	must(kube.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: meta(ns+"-"+sa+"-csi-driver", ""),
		RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "harvesterhci.io:csi-driver"}, Subjects: subject}, metav1.CreateOptions{}))
	must(kube.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: meta(sa, ns),
		RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "harvesterhci.io:cloudprovider"}, Subjects: subject}, metav1.CreateOptions{}))
	must(kube.RbacV1().Roles(ns).Create(ctx, &rbacv1.Role{ObjectMeta: meta("harvester-csi-driver:hotplug-requests", ns),
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{"kubevirt.io"}, Resources: []string{"virtualmachines/status"}, Verbs: []string{"patch"}}}}, metav1.CreateOptions{}))
	must(kube.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: meta(sa+"-hotplug-requests", ns),
		RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "harvester-csi-driver:hotplug-requests"}, Subjects: subject}, metav1.CreateOptions{}))
	secret := &corev1.Secret{ObjectMeta: meta(sa+"-token", ns), Type: corev1.SecretTypeServiceAccountToken}
	secret.Annotations = map[string]string{corev1.ServiceAccountNameKey: sa}
	must(kube.CoreV1().Secrets(ns).Create(ctx, secret, metav1.CreateOptions{}))
	return []legacyObject{
		{"ClusterRoleBinding " + ns + "-" + sa + "-csi-driver", func(ctx context.Context) error {
			_, err := kube.RbacV1().ClusterRoleBindings().Get(ctx, ns+"-"+sa+"-csi-driver", metav1.GetOptions{})
			return err
		}},
		{"Role harvester-csi-driver:hotplug-requests", func(ctx context.Context) error {
			_, err := kube.RbacV1().Roles(ns).Get(ctx, "harvester-csi-driver:hotplug-requests", metav1.GetOptions{})
			return err
		}},
		{"RoleBinding " + sa + "-hotplug-requests", func(ctx context.Context) error {
			_, err := kube.RbacV1().RoleBindings(ns).Get(ctx, sa+"-hotplug-requests", metav1.GetOptions{})
			return err
		}},
		{"Secret " + sa + "-token", func(ctx context.Context) error {
			_, err := kube.CoreV1().Secrets(ns).Get(ctx, sa+"-token", metav1.GetOptions{})
			return err
		}},
		{"RoleBinding " + sa + " to harvesterhci.io:cloudprovider", func(ctx context.Context) error {
			rb, err := kube.RbacV1().RoleBindings(ns).Get(ctx, sa, metav1.GetOptions{})
			if err == nil && rb.RoleRef.Name != "harvesterhci.io:cloudprovider" {
				return apierrors.NewNotFound(rbacv1.Resource("rolebindings"), sa)
			}
			return err
		}},
	}
}

var rwxMount = &csi.VolumeCapability{
	AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
	AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
}

// rwxFlow: a ReadWriteMany volume's NetworkFilesystem is created, enabled,
// waited for and deleted in harvester-system.
func rwxFlow(ctx context.Context, t *testing.T, c csi.ControllerClient, vm, prefix string) {
	t.Helper()
	var vol string
	if err := callUntilFinal(ctx, func(ctx context.Context) error {
		r, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: prefix + "-rwx", VolumeCapabilities: []*csi.VolumeCapability{rwxMount},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}})
		vol = r.GetVolume().GetVolumeId()
		return err
	}); err != nil {
		t.Fatalf("create RWX volume: %v", err)
	}
	if err := callUntilFinal(ctx, func(ctx context.Context) error {
		_, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: vm, VolumeCapability: rwxMount})
		return err
	}); err != nil {
		t.Errorf("publish RWX volume %s: %v", vol, err)
	}
	if err := unpublish(ctx, c, vm, vol); err != nil {
		t.Errorf("unpublish RWX volume %s: %v", vol, err)
	}
	if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol}); err != nil {
		t.Errorf("DeleteVolume %s: %v", vol, err)
	}
}
