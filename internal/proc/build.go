package proc

import (
	"context"
	"fmt"
	"os"
	"os/exec"

	"github.com/harvester-csi/harvester-csi-driver/internal/checkout"
)

// Build compiles the main package pkg of this checkout into out, statically
// (CGO_ENABLED=0) as the image's binary is built, from the checkout's root so
// the caller's working directory does not matter.
func Build(ctx context.Context, out, pkg string) error {
	root, err := checkout.Root()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, pkg)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %w\n%s", pkg, err, b)
	}
	return nil
}
