package diagnose

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// StatePath is where the controller serves its hotplug queue's state (JSON,
// a list of hotplug.VMState) on its metrics address.
const StatePath = "/debug/hotplug"

// Sources say where Gather reads from. Host is required; the others may be
// empty, and their checks are then left out.
type Sources struct {
	Host  *host.Client
	Guest kubernetes.Interface
	// Controller is the base URL of the controller's metrics address.
	Controller string
	Driver     string
}

// Gather reads everything Check needs.
func Gather(ctx context.Context, src Sources) (Input, error) {
	in := Input{Driver: src.Driver, Now: time.Now()}
	var err error
	if in.VMs, err = src.Host.ListVMs(ctx); err != nil {
		return in, fmt.Errorf("list host VMs: %w", err)
	}
	if in.VMIs, err = src.Host.ListVMIs(ctx); err != nil {
		return in, fmt.Errorf("list host VMIs: %w", err)
	}
	if src.Guest != nil {
		vas, err := src.Guest.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		if err != nil {
			return in, fmt.Errorf("list guest VolumeAttachments: %w", err)
		}
		pvs, err := src.Guest.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return in, fmt.Errorf("list guest PersistentVolumes: %w", err)
		}
		nodes, err := src.Guest.StorageV1().CSINodes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return in, fmt.Errorf("list guest CSINodes: %w", err)
		}
		in.VolumeAttachments, in.PersistentVolumes, in.CSINodes = vas.Items, pvs.Items, nodes.Items
	}
	if src.Controller != "" {
		if in.Queue, err = queueState(ctx, src.Controller); err != nil {
			return in, err
		}
	}
	return in, nil
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
