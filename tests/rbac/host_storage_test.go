package rbac

import (
	"context"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	kvbackend "github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// storageGrants are the rows --storage-read adds, by verb and resource.
var storageGrants = []grant{
	{Resource: "events", Verb: "list"},
	{Group: "longhorn.io", Resource: "volumes", Verb: "get"},
	{Group: "longhorn.io", Resource: "volumeattachments", Verb: "get"},
	{Resource: "persistentvolumes", Verb: "get"},
}

// viaProxy is the identity of a kubeconfig the script wrote, reaching the
// simulator's front proxy (which counts its requests and their answers).
func viaProxy(t *testing.T, h *framework.Host, kubeconfig string) *rest.Config {
	t.Helper()
	written, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cfg := rest.AnonymousClientConfig(written)
	cfg.Host, cfg.TLSClientConfig, cfg.BearerToken = h.Sim.ProxyURL(), rest.TLSClientConfig{}, written.BearerToken
	return cfg
}

// TestHostStorageReadsAsTheIdentity: on a real API server with Longhorn's
// CRDs, ControllerGetVolume run as the identity hack/host-rbac.sh creates
// with --storage-read says that the volume's Longhorn volume is faulted, and
// every rule the option adds is used by the reads; run as an identity
// without the option, the same call answers a normal condition and no
// error, and the only requests refused are the optional reads.
func TestHostStorageReadsAsTheIdentity(t *testing.T) {
	if _, err := exec.LookPath("kubectl"); err != nil {
		t.Skip("kubectl not installed: hack/host-rbac.sh needs it")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_7_0, Scale: 0.05, BindClasslessPVCs: true})
	// waiting-vm stands for a VM the volume is on its way to: KubeVirt has
	// made no attachment pod of the volume for it.
	h.CreateVMs(t, "rbac-vm", "waiting-vm")
	if err := simlonghorn.InstallCRDs(ctx, h.Env.Config); err != nil {
		t.Fatal(err)
	}
	if _, err := h.Kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: host.LonghornNamespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	base := []string{"--host-kubeconfig", h.Env.Kubeconfig, "--namespace", h.Namespace}
	withReads, without := filepath.Join(dir, "with"), filepath.Join(dir, "without")
	script(t, ctx, append(base, "--output", withReads, "--token-duration", "1h", "--storage-read")...)
	script(t, ctx, append(base, "--service-account", "plain-driver", "--output", without, "--token-duration", "1h")...)

	startAs := func(kubeconfig string) *framework.Controller {
		t.Helper()
		return h.StartController(t, framework.ControllerOptions{Backend: kvbackend.BackendDeclarative, Config: viaProxy(t, h, kubeconfig),
			Queue:  hotplug.Config{BatchWindow: 50 * time.Millisecond, MaxHold: 2 * time.Second},
			Driver: driver.ControllerOptions{HostStorageClass: "longhorn"}})
	}
	getVolume := func(ctrl *framework.Controller, vol string) *csi.VolumeCondition {
		t.Helper()
		resp, err := ctrl.Client.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: vol})
		if err != nil {
			t.Fatalf("ControllerGetVolume %s: %v", vol, err)
		}
		if !slices.Equal(resp.GetStatus().GetPublishedNodeIds(), []string{"rbac-vm"}) {
			t.Errorf("published on %v, want rbac-vm", resp.GetStatus().GetPublishedNodeIds())
		}
		return resp.GetStatus().GetVolumeCondition()
	}

	// A volume on the VM, and its Longhorn volume faulted.
	ctrl := startAs(withReads)
	vol := createVolume(ctx, t, ctrl.Client, "pvc-storage", "")
	if err := publish(ctx, ctrl.Client, "rbac-vm", vol); err != nil {
		t.Fatalf("publish %s: %v", vol, err)
	}
	pvc, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Get(ctx, vol, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pv, err := h.Kube.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil || pv.Spec.CSI == nil {
		t.Fatalf("the host PV of %s: %v, %v", vol, pv, err)
	}
	lhName := pv.Spec.CSI.VolumeHandle
	faultLonghornVolume(ctx, t, dynamic.NewForConfigOrDie(h.Env.Config), lhName, pv.Name, vol, h.Namespace)

	h.Sim.ResetStats()
	cond := getVolume(ctrl, vol)
	ctrl.Stop()
	if !cond.GetAbnormal() || !strings.Contains(cond.GetMessage(), "Longhorn volume "+lhName+" is not ready for workloads") ||
		!strings.Contains(cond.GetMessage(), "waiting: volume is faulted") {
		t.Errorf("with --storage-read: condition %+v, want abnormal naming the faulted Longhorn volume and its ticket", cond)
	}
	// The attachment pods and Events of a VM still waiting for the volume,
	// as the condition reads them for such a VM: no attachment pod has the
	// claim, so KubeVirt's Events on its VMI are read.
	hc, err := host.NewForConfig(viaProxy(t, h, withReads), h.Namespace)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := host.NewStorageReader(hc).Issues(ctx, host.StorageQuery{Claim: pvc, Holders: []string{"rbac-vm", "waiting-vm"}, Waiting: []string{"waiting-vm"}}); err != nil {
		t.Errorf("host storage reads as the identity with --storage-read: %v", err)
	}
	used, forbidden := usedGrants(h.Sim.Stats())
	if len(forbidden) > 0 {
		t.Errorf("with --storage-read the driver was refused: %v", forbidden)
	}
	for _, g := range storageGrants {
		if !used[g] {
			t.Errorf("--storage-read grants %s, which no read used", g)
		}
	}

	h.Sim.ResetStats()
	ctrl = startAs(without)
	cond = getVolume(ctrl, vol)
	ctrl.Stop()
	if cond.GetAbnormal() {
		t.Errorf("without --storage-read: condition %+v, want normal (the Longhorn volume cannot be read)", cond)
	}
	_, forbidden = usedGrants(h.Sim.Stats())
	for _, f := range forbidden {
		// The KubeVirt CR's version is a best-effort read too (the queue
		// keeps its safe strategy without it; hack/host-rbac.sh
		// --kubevirt-read grants it).
		optional := strings.HasSuffix(f, "kubevirt.io/kubevirts")
		for _, g := range storageGrants {
			optional = optional || f == g.String()
		}
		if !optional {
			t.Errorf("without --storage-read the driver was refused %s, which is not an optional read", f)
		}
	}
	if len(forbidden) == 0 {
		t.Error("without --storage-read no read was refused: the test did not exercise a refusal")
	}
}

// faultLonghornVolume writes the Longhorn volume of a host PV as
// longhorn-manager v1.10.1 leaves a faulted one (detached, robustness
// faulted) and its VolumeAttachment with a CSI ticket Longhorn cannot
// satisfy.
func faultLonghornVolume(ctx context.Context, t *testing.T, dyn dynamic.Interface, name, pv, claim, ns string) {
	t.Helper()
	vols := dyn.Resource(host.LonghornVolumeResource).Namespace(host.LonghornNamespace)
	v := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "longhorn.io/v1beta2", "kind": "Volume",
		"metadata": map[string]any{"name": name, "namespace": host.LonghornNamespace},
		"spec":     map[string]any{"accessMode": "rwx", "migratable": true, "numberOfReplicas": int64(3)},
	}}
	created, err := vols.Create(ctx, v, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	created.Object["status"] = map[string]any{"state": "detached", "robustness": "faulted",
		"kubernetesStatus": map[string]any{"pvName": pv, "namespace": ns, "pvcName": claim}}
	if _, err := vols.UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	vas := dyn.Resource(host.LonghornAttachmentResource).Namespace(host.LonghornNamespace)
	ticket := "csi-" + name
	va := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "longhorn.io/v1beta2", "kind": "VolumeAttachment",
		"metadata": map[string]any{"name": name, "namespace": host.LonghornNamespace},
		"spec": map[string]any{"volume": name, "attachmentTickets": map[string]any{
			ticket: map[string]any{"id": ticket, "type": "csi-attacher", "nodeID": "host-node-1", "generation": int64(0)}}},
	}}
	created, err = vas.Create(ctx, va, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	created.Object["status"] = map[string]any{"attachmentTicketStatuses": map[string]any{
		ticket: map[string]any{"id": ticket, "satisfied": false, "generation": int64(0),
			"conditions": []any{map[string]any{"type": "Satisfied", "status": "False", "message": "volume is faulted"}}}}}
	if _, err := vas.UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}
