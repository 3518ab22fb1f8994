package diagnose

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
)

// StatePath is where the controller serves its hotplug queue's state (JSON,
// a list of hotplug.VMState) on its metrics address.
const StatePath = "/debug/hotplug"

// Sources say where Gather reads from. Host is required; the others may be
// empty, and their checks are then left out.
type Sources struct {
	Host  *host.Client
	Guest kubernetes.Interface
	// Controller is the base URL of the controller's metrics address: that
	// one replica is read, and failing to read it fails Gather.
	Controller string
	// Replicas, without Controller and with Guest, finds the replica to
	// read through the guest API (see replicaQueue).
	Replicas *Replicas
	Driver   string
}

// Gather reads everything Check needs.
func Gather(ctx context.Context, src Sources) (Input, error) {
	in := Input{Driver: src.Driver, Namespace: src.Host.Namespace, Now: time.Now()}
	if err := gatherHost(ctx, src.Host, &in); err != nil {
		return in, err
	}
	if src.Guest != nil {
		if err := gatherGuest(ctx, src.Guest, &in); err != nil {
			return in, err
		}
	}
	switch {
	case src.Controller != "":
		var err error
		if in.Queue, err = queueState(ctx, src.Controller); err != nil {
			return in, err
		}
		in.QueueSource = src.Controller
	case src.Replicas != nil && src.Guest != nil:
		var notes []string
		in.Queue, in.QueueSource, notes = replicaQueue(ctx, src.Guest, *src.Replicas, src.Driver, queueState)
		in.Notes = append(in.Notes, notes...)
	}
	return in, nil
}

func gatherHost(ctx context.Context, hc *host.Client, in *Input) error {
	var err error
	if in.VMs, err = kubevirt.NewReader(hc).ListVMs(ctx); err != nil {
		return fmt.Errorf("list host VMs: %w", err)
	}
	if in.VMIs, err = kubevirt.NewReader(hc).ListVMIs(ctx); err != nil {
		return fmt.Errorf("list host VMIs: %w", err)
	}
	claims, err := hc.Kube.CoreV1().PersistentVolumeClaims(hc.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list host PVCs: %w", err)
	}
	in.HostClaims = claims.Items
	gatherHostPods(ctx, hc, in)
	gatherHostStorage(ctx, host.NewStorageReader(hc), in)
	return gatherNetworkFS(ctx, hc, in)
}

// gatherHostPods reads KubeVirt's attachment pods and the virt-launcher pods
// that own them. The host identity may lack `list pods` (one made before the
// guest node monitor needed it): then a note says so and the pods are not
// judged; diagnose still looks at everything else.
func gatherHostPods(ctx context.Context, hc *host.Client, in *Input) {
	sel := kubevirtAppLabel + " in (" + attachmentPodApp + "," + launcherPodApp + ")"
	pods, err := hc.Kube.CoreV1().Pods(hc.Namespace).List(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		in.Notes = append(in.Notes, "host pods not readable ("+err.Error()+"): attachment pods not checked")
		return
	}
	in.HostPods, in.HostPodsRead = pods.Items, true
}

// gatherNetworkFS reads Harvester's NFS exports. A host without the kind
// (no networkfs-manager) has none; an identity that may not read them (one
// made before ReadWriteMany volumes were served) leaves ReadWriteMany
// attachments unjudged, said in a note, rather than failing the whole look.
func gatherNetworkFS(ctx context.Context, hc *host.Client, in *Input) error {
	list, err := hc.Dynamic.Resource(host.NetworkFSResource).Namespace(host.NetworkFSNamespace).List(ctx, metav1.ListOptions{})
	switch {
	case apierrors.IsNotFound(err):
		in.NetworkFSRead = true
		return nil
	case apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err):
		in.Notes = append(in.Notes, "NetworkFilesystems not readable ("+err.Error()+"): ReadWriteMany attachments not checked")
		return nil
	case err != nil:
		return fmt.Errorf("list NetworkFilesystems in %s: %w", host.NetworkFSNamespace, err)
	}
	for i := range list.Items {
		var fs host.NetworkFS
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(list.Items[i].Object, &fs); err != nil {
			return fmt.Errorf("NetworkFilesystem %s: %w", list.Items[i].GetName(), err)
		}
		in.NetworkFilesystems = append(in.NetworkFilesystems, fs)
	}
	in.NetworkFSRead = true
	return nil
}

func gatherGuest(ctx context.Context, guest kubernetes.Interface, in *Input) error {
	vas, err := guest.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list guest VolumeAttachments: %w", err)
	}
	pvs, err := guest.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list guest PersistentVolumes: %w", err)
	}
	csiNodes, err := guest.StorageV1().CSINodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list guest CSINodes: %w", err)
	}
	nodes, err := guest.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list guest Nodes: %w", err)
	}
	in.VolumeAttachments, in.PersistentVolumes, in.CSINodes, in.Nodes = vas.Items, pvs.Items, csiNodes.Items, nodes.Items
	in.GuestRead = true
	return nil
}

func queueState(ctx context.Context, base string) ([]hotplug.VMState, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+StatePath, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("read the controller's queue state: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("read the controller's queue state: %s", resp.Status)
	}
	var out []hotplug.VMState
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return nil, fmt.Errorf("decode the controller's queue state: %w", err)
	}
	return out, nil
}

// StateHandler serves a queue's state at StatePath. state returns nil while
// the controller has no queue yet.
func StateHandler(state func() []hotplug.VMState) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		st := state()
		if st == nil {
			st = []hotplug.VMState{}
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(st)
	})
}
